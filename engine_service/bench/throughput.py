"""`decodelab bench throughput`: offline throughput on a traffic-shaped workload, against HF
static batches and HF continuous batching, plus the compute roofline, single-stream decode (against
llama.cpp on the same GGUF file when llama-cpp-python is installed: bench/llamacpp.py) and KV-slot
waste. Writes benchmarks/results/throughput.json and throughput.png."""
import platform
import time

import torch

from engine_service.bench import llamacpp
from engine_service.bench.common import (
    cpu_info,
    matmul_peak_gflops,
    median,
    mixed_workload,
    pyplot,
    write_results,
    write_with_plot,
)
from engine_service.engine.models.loader import head_dim as hf_head_dim
from engine_service.engine.roofline import engine_roofs
from engine_service.engine.sampling_params import SamplingParams


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("throughput", help="offline throughput vs HF generate / generate_batch")
    add_engine_args(p)
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--skip-hf", action="store_true", help="only measure our engine")
    p.add_argument("--hf-baselines", default="static,continuous",
                   help="which HF baselines: static (generate in static batches, the target's), continuous "
                        "(generate_batch, ~15 min on 2 cores), or both")
    p.add_argument("--skip-llamacpp", action="store_true", help="no llama.cpp single-stream anchor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


def run_engine(llm, work) -> dict:
    """All requests at once; samples KV slot usage after every step."""
    engine, bs = llm.engine, llm.engine.config.block_size
    for i, (prompt, out) in enumerate(zip(work.prompts, work.max_tokens)):
        engine.add_request(f"bench-{i}", prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=out))
    paged, contiguous, filled_total, steps = 0, 0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        filled = sum(s.num_computed_tokens for s in running)
        paged += sum(len(s.block_table) for s in running) * bs
        contiguous += sum(s.num_prompt_tokens + s.request.params.max_tokens for s in running)
        filled_total += filled
        steps += 1
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed, "tok_per_s": work.output_tokens / elapsed, "steps": steps,
            "kv_waste_paged": 1 - filled_total / max(paged, 1),
            "kv_waste_contiguous_request_max": 1 - filled_total / max(contiguous, 1),
            "preemptions": engine.scheduler.num_preemptions}


SINGLE_STREAM = dict(prompt_len=32, new_tokens=128)  # ours and llama.cpp's alike


def single_stream(llm, prompt_len: int = 32, new_tokens: int = 128) -> dict:
    tpots = []
    for r in range(3):
        out = llm.generate({"prompt_token_ids": list(range(100 + r, 100 + r + prompt_len))},
                           SamplingParams(temperature=0, ignore_eos=True, max_tokens=new_tokens))[0]
        tpots.append(out.metrics.tpot)
    return {"tok_per_s": 1 / median(tpots), "tpot_ms": median(tpots) * 1e3, "runs": len(tpots)}


def matmul_flops_per_token(model) -> int:
    """2 x the weights every decode token multiplies (all linears + the LM head)."""
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return 2 * (n + model.config.vocab_size * model.config.hidden_size * (model.lm_head is None))


def linear_paths(model, rows=(1, 2, 8, 128, 512), repeats: int = 5) -> dict:
    """All matmuls of one forward (random weights of the model's shapes) with `rows` tokens: torch's default
    F.linear vs the oneDNN-packed weights the engine uses on CPU (docs/kernels.md). Median ms per forward."""
    from engine_service.engine.models.packed_linear import pack_weight, packed_linear, packing_enabled

    if not packing_enabled(torch.device("cpu"), torch.float32):
        return {}
    shapes = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.lm_head is None:
        shapes.append((model.config.vocab_size, model.config.hidden_size))
    dense = [torch.randn(shape) for shape in shapes]
    packed = [pack_weight(w) for w in dense]
    out = {}
    for n in rows:
        xs = [torch.randn(n, w.shape[1]) for w in dense]

        def timed(fn) -> float:
            fn()
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return median(times) * 1e3
        a = timed(lambda: [torch.nn.functional.linear(x, w) for x, w in zip(xs, dense)])  # noqa: B023 (called here)
        b = timed(lambda: [packed_linear(x, w, None) for x, w in zip(xs, packed)])  # noqa: B023
        out[str(n)] = {"f_linear_ms": a, "packed_ms": b, "ratio": a / b}
    return out


def _decode_steps(engine, batch: int, context: int, steps: int, tag: str) -> tuple[list[float], list[float]]:
    """`batch` sequences of `context` prompt tokens prefilled, then `steps` decode steps timed: (seconds, mean keys
    a new token attends to) per step. Raises if fewer than `batch` sequences decode."""
    # chunked prefill decodes the sequences whose prompts are done while the rest prefill: max_tokens leaves room
    # for those steps, so that all `batch` sequences still decode in the timed steps (aborted after them)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=context + steps)
    ids = [f"roof-{tag}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(rid, [100 + (i + j) % 5000 for j in range(context)], params)
    while any(s.num_computed_tokens < s.num_tokens - 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill everything
    times, keys = [], []
    for _ in range(steps):
        running = engine.scheduler.running
        if len(running) != batch:
            raise RuntimeError(f"batched decode: {len(running)} of {batch} sequences decode "
                               "(too few KV blocks or max_num_seqs for the batch)")
        keys.append(sum(s.num_tokens for s in running) / batch)  # the keys a new token attends to, on average
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort(rid)
    return times, keys


def batched_decode(llm, batch: int, context: int, steps: int = 8) -> dict:
    """Steady-state decode steps of `batch` sequences at ~`context` tokens (`mean_keys`: the mean context a
    timed step attends over): FLOP rate vs the roof.

    The batch runs twice and the second run is timed (its prompts hit the prefix cache, so it prefills in a few
    steps); `cold_step_ms` is the first run's median step. The first run is the first to write most of the KV
    blocks it uses, and the pool's memory is mapped on first touch (model_runner.lazy_zeros), a cost each page pays
    once in a process's life: on the 2-core VM (AMD Zen 5) ~4.6 ms a 2 MiB huge page, 13-30 ms of each of the first
    run's 128 x 256 steps as its sequences cross into new blocks."""
    engine = llm.engine
    cold, _ = _decode_steps(engine, batch, context, steps, "cold")
    times, keys = _decode_steps(engine, batch, context, steps, "timed")
    cfg, model = engine.runner.hf_config, engine.runner.model
    head_dim = hf_head_dim(cfg)
    mean_keys, step = median(keys), median(times)
    attn = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim * mean_keys
    flops = batch * (matmul_flops_per_token(model) + attn)
    return {"batch": batch, "context": context, "mean_keys": mean_keys, "step_ms": step * 1e3,
            "cold_step_ms": median(cold) * 1e3, "gflops": flops / step / 1e9, "tok_per_s": batch / step}


def decode_roof(llm, peak_gflops: float) -> float:
    """The compute roof batched decode is measured against, in G(FL)OP/s: the float GEMM peak, or for int8
    weights the engine's int8 linear (roofline.engine_roofs), whose integer multiply-adds outrun float FMAs."""
    if llm.engine.config.quantization != "int8":
        return peak_gflops
    return engine_roofs(llm.engine).flops_per_s / 1e9


def run(args) -> int:
    from engine_service.engine.flags import engine_config_from_args
    from engine_service.engine.llm import LLM

    llm = LLM(config=engine_config_from_args(args))
    vocab = llm.engine.vocab_size
    work = mixed_workload(args.num_requests, vocab, seed=args.seed)
    res = {"model": args.model, "dtype": llm.engine.config.dtype, "quantization": llm.engine.config.quantization,
           "threads": torch.get_num_threads(),
           "machine": f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads",
           "cpu": cpu_info(),
           "workload": {"requests": len(work.prompts), "prompt_tokens": sum(map(len, work.prompts)),
                        "output_tokens": work.output_tokens}}
    peak = matmul_peak_gflops()
    res["peak_gflops"], res["peak_gflops_by_path"] = peak["gflops"], peak["by_path"]
    print(f"fp32 matmul peak: {res['peak_gflops']:.1f} GFLOP/s {peak['by_path']}", flush=True)
    llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4))  # warm-up

    def save() -> None:  # after every phase: an interrupted HF baseline loses nothing of ours
        write_results("throughput", res, args.out)

    res["ours"] = run_engine(llm, work)
    save()
    print(f"ours: {res['ours']['tok_per_s']:.1f} tok/s", flush=True)
    res["single_stream"] = single_stream(llm, **SINGLE_STREAM)
    print(f"single stream: {res['single_stream']['tok_per_s']:.1f} tok/s", flush=True)
    res["llamacpp_single_stream"] = ({"skipped": "--skip-llamacpp"} if args.skip_llamacpp
                                     else llamacpp.single_stream(args.model, res["threads"], **SINGLE_STREAM))
    anchor = res["llamacpp_single_stream"]
    if "tok_per_s" in anchor:
        res["single_stream"]["vs_llamacpp"] = res["single_stream"]["tok_per_s"] / anchor["tok_per_s"]
        build = anchor["build"].get("cmake_flags") or [anchor["build"]["lib"]]  # which llama.cpp made the figure
        print(f"llama.cpp single stream: {anchor['tok_per_s']:.1f} tok/s ({' '.join(build)}), ours / llama.cpp "
              f"{res['single_stream']['vs_llamacpp']:.2f}x (goal >= 0.5x)", flush=True)
    else:
        print(f"llama.cpp single stream: skipped ({anchor['skipped']})", flush=True)
    save()
    res["batched_decode"] = batched_decode(llm, batch=min(128, args.max_num_seqs), context=256)
    roof = decode_roof(llm, res["peak_gflops"])
    if roof != res["peak_gflops"]:
        res["int8_roof_gops"] = roof
    res["batched_decode"]["roofline_fraction"] = res["batched_decode"]["gflops"] / roof
    print(f"batched decode: {res['batched_decode']}", flush=True)
    res["linear_paths"] = linear_paths(llm.engine.runner.model)
    print(f"linears of one forward, F.linear vs packed: {res['linear_paths']}", flush=True)
    save()
    if not args.skip_hf:
        from engine_service.bench.hf_baselines import load_hf, run_hf_baselines
        from engine_service.engine.models.loader import resolve_model

        del llm  # give the memory back before HF loads its copy
        hf = load_hf(resolve_model(args.model))
        which = tuple(f"hf_{name.strip()}" for name in args.hf_baselines.split(",") if name.strip())
        res.update(run_hf_baselines(hf, work, args.hf_batch_size, which=which))
        ours = res["ours"]["tok_per_s"]
        res["ratios"] = {f"vs_{k}": ours / res[k]["tok_per_s"] for k in ("hf_static", "hf_continuous")
                         if "tok_per_s" in res.get(k, {})}
        if "useful_fraction" in res.get("hf_static", {}):
            res["ratios"]["vs_hf_static_ideal"] = 1 / res["hf_static"]["useful_fraction"]
    write_with_plot("throughput", res, args.out, plot)
    return 0


def plot(res: dict, path) -> None:
    plt = pyplot()

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4))
    runs = [("DecodeLab", "ours", "tab:green"), ("HF generate\n(static batches)", "hf_static", "tab:gray"),
            ("HF generate_batch\n(continuous)", "hf_continuous", "tab:blue")]
    runs = [r for r in runs if "tok_per_s" in res.get(r[1], {})]
    vals = [res[key]["tok_per_s"] for _, key, _ in runs]
    a.bar([label for label, _, _ in runs], vals, color=[color for _, _, color in runs])
    a.set_ylabel("generated tok/s")
    weights = " int8 weights" if res.get("quantization") == "int8" else ""
    a.set_title(f"{res['model']} {res['dtype']}{weights}, {res['workload']['requests']} requests")
    for i, v in enumerate(vals):
        a.text(i, v, f"{v:.0f}", ha="center", va="bottom")
    waste = [res["ours"]["kv_waste_paged"], res["ours"]["kv_waste_contiguous_request_max"]]
    b.bar(["paged (ours)", "contiguous\n(prompt + max_tokens)"], [100 * w for w in waste],
          color=["tab:green", "tab:gray"])
    b.set_ylabel("KV slots allocated but unused (%)")
    b.set_title("KV waste, time-averaged")
    goals = [("single stream\n(tok/s, goal 25)", res.get("single_stream", {}).get("tok_per_s"), 25),
             ("batched decode\n(% of the roof, goal 40)",
              100 * res["batched_decode"]["roofline_fraction"] if "batched_decode" in res else None, 40)]
    anchor = res.get("llamacpp_single_stream", {}).get("tok_per_s")
    if anchor is not None:  # beside ours; ours / llama.cpp goal >= 0.5x
        goals.insert(1, (f"llama.cpp, same GGUF\n(tok/s; ours\n{res['single_stream']['vs_llamacpp']:.2f}x, goal 0.5)",
                         anchor, None))
    goals = [g for g in goals if g[1] is not None]
    c.bar([g[0] for g in goals], [g[1] for g in goals],
          color=["tab:gray" if g[2] is None else "tab:green" for g in goals])
    for i, (_, v, goal) in enumerate(goals):
        c.text(i, v, f"{v:.1f}", ha="center", va="bottom")
        if goal is not None:
            c.hlines(goal, i - 0.4, i + 0.4, colors="black", linestyles="--")
    roof = (f"int8 roof {res['int8_roof_gops']:.0f} Gop/s" if "int8_roof_gops" in res
            else f"roof {res.get('peak_gflops', 0):.0f} GFLOP/s")
    c.set_title(f"decode ({roof}); dashed: goals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)

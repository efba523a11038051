"""`decodelab bench pipeline`: what the sampler pipeline (SamplingParams.sampler_stages) costs a four-mode step.

The playground's four requests (web/modes.py at its defaults, the example prompt) run together in one LLMEngine,
twice per repeat: as the playground sends them without the "Sampler pipeline" box, and with it (greedy and
sampling then ask for PIPELINE_TOKENS tokens per stage). The two alternate, so both see the same machine state.
A four-mode step is an engine.step() while all four requests decode (every prompt prefilled, none finished). Reports
per variant the median step ms and TPOT of the sampled request, and the ratio with / without; off, the sampler runs
the code it runs without this feature (no Tracer), so its cost there is the `tracer is not None` checks.
Runs play's configuration (server/play.apply_play_defaults). Writes benchmarks/results/pipeline.json and .png.
"""
from __future__ import annotations

import argparse
import time

from engine_service.bench.common import cpu_info, median, pyplot, write_with_plot

PROMPT = "Why is the sky blue?"
MODES = ("greedy", "beam", "sample", "speculative")
VARIANTS = ("off", "on")


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("pipeline", help="the sampler pipeline's cost: a four-mode step with it and without")
    add_engine_args(p)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="runs per variant (after one warm-up of each), alternating")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


def _params(prompt: str, max_tokens: int, pipeline: bool) -> tuple[str | None, dict]:
    """The playground's four requests as SamplingParams keyword dicts, and their chat messages."""
    from web.modes import Settings, build_request

    settings = Settings(prompt=prompt, max_tokens=max_tokens, pipeline=pipeline)
    reqs = {m: build_request(m, settings) for m in MODES}
    messages = [m.model_dump() for m in reqs["greedy"].messages]
    return messages, {m: r.params.model_dump() for m, r in reqs.items()}


def _one_run(engine, prompt: str, params: dict, tag: str) -> dict:
    """Step times (s) while all four decode, and the sampled request's TPOT (s)."""
    from engine_service.engine.sampling_params import SamplingParams

    for mode, p in params.items():
        engine.add_request(f"{tag}-{mode}", prompt, SamplingParams(**p))
    steps, first, last, tokens, running = [], {}, {}, {}, set(params)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt, now = time.perf_counter() - t0, time.perf_counter()
        four = len(first) == len(params) and len(running) == len(params)  # all decoding before this step
        for out in outs:
            mode = out.request_id.split("-", 1)[1]
            n = len(out.outputs[0].token_ids) if out.outputs else 0
            if n and mode not in first:
                first[mode] = now
            last[mode], tokens[mode] = now, n
            if out.finished:
                running.discard(mode)
        if four:
            steps.append(dt)
    n = tokens.get("sample", 0)
    return {"steps": steps, "sample_tpot": (last["sample"] - first["sample"]) / (n - 1) if n > 1 else None}


def run(args: argparse.Namespace) -> int:
    import torch

    from engine_service.engine.flags import engine_config_from_args
    from engine_service.engine.llm_engine import LLMEngine
    from engine_service.server.play import apply_play_defaults

    apply_play_defaults(args)  # what play runs unless told otherwise: int8 weights and one core left on a CPU
    engine = LLMEngine(engine_config_from_args(args))
    variants = {}
    for name in VARIANTS:
        messages, params = _params(args.prompt, args.max_tokens, name == "on")
        variants[name] = params
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for i in range(args.repeats + 1):
        for name in VARIANTS if i % 2 == 0 else reversed(VARIANTS):  # alternate which goes first
            r = _one_run(engine, prompt, variants[name], f"{name}{i}")
            if i:  # the first round warms both up
                runs[name].append(r)
    summary = {}
    for name in VARIANTS:
        steps = [s for r in runs[name] for s in r["steps"]]
        tpots = [r["sample_tpot"] for r in runs[name] if r["sample_tpot"] is not None]
        summary[name] = {"step_ms": median(steps) * 1e3 if steps else None, "steps": len(steps),
                         "sample_tpot_ms": median(tpots) * 1e3 if tpots else None}
    on, off = summary["on"]["step_ms"], summary["off"]["step_ms"]
    results = {"benchmark": "pipeline", "model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens,
               "repeats": args.repeats, "cpu": cpu_info(), "threads": args.threads or torch.get_num_threads(),
               "quantization": getattr(args, "quantization", None), "variants": summary,
               "step_ratio": on / off if on and off else None, "params": variants}
    write_with_plot("pipeline", results, args.out, _plot)
    def ms(x: float | None) -> str:
        return "–" if x is None else f"{x:.2f} ms"

    for name, s in summary.items():
        print(f"pipeline {name:>3}: four-mode step {ms(s['step_ms'])} (median of {s['steps']}), "
              f"sampling TPOT {ms(s['sample_tpot_ms'])}")
    print(f"with / without: {results['step_ratio']:.3f}" if results["step_ratio"] else "with / without: –")
    return 0


def _plot(results: dict, path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.2))
    names = list(results["variants"])
    values = [results["variants"][n]["step_ms"] or 0 for n in names]
    ax.bar(names, values, color=["#64748b", "#d97706"])
    for x, v in enumerate(values):
        ax.text(x, v, f"{v:.1f} ms", ha="center", va="bottom")
    ratio = results.get("step_ratio")
    ax.set_title("Four-mode step, sampler pipeline off / on" + (f" (x{ratio:.3f})" if ratio else ""))
    ax.set_ylabel("median ms per step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""`decodelab bench structured`: what grammar-constrained decoding (engine/structured.py) costs per engine step.

A batch of `--batch` sampling requests decodes `--steps` timed steps (after every request has its first token),
unconstrained and under each grammar, `--repeats` times round-robin (the median counts). Each grammar forces a
long output (a string of at least 300 characters, or a long run of words) so the batch stays whole while it is
timed. Around the constrained runs, the three pieces of the mechanism are timed separately: filling the token
bitmask from each sequence's matcher (`masks`), applying it to the logits (`apply_mask`) and advancing the matchers
with the drawn tokens (`GrammarState.sync`).

Reported per grammar: the mean step time, the mask's own time per step, and its cost as a fraction of the
unconstrained step (`mask_fraction`, the target is <= 10%); `step_overhead` is the end-to-end difference, noisier on
a shared machine. JSON + PNG under --out.
"""
from __future__ import annotations

import platform
import time
from contextlib import contextmanager

import torch

from engine_service.bench.common import median, pyplot, write_with_plot
from engine_service.engine import llm_engine, sampler
from engine_service.engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine_service.engine.structured import GrammarState

TARGET_FRACTION = 0.10
GRAMMARS = {
    "json_schema": StructuredOutputsParams(json={
        "type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                         "story": {"type": "string", "minLength": 300, "maxLength": 2000}},
        "required": ["title", "story"]}),
    # a character class under a bounded repetition; a group under one, ([A-Za-z]+ ){80,400}, is unrolled by
    # xgrammar and costs ~12 ms a row to fill (docs/decoding.md)
    "regex": StructuredOutputsParams(regex=r"[A-Za-z ,]{300,2000}\."),
    "choice_then_json": StructuredOutputsParams(json={
        "type": "object", "properties": {"kind": {"enum": ["poem", "story", "letter"]},
                                         "text": {"type": "string", "minLength": 300}},
        "required": ["kind", "text"]}),
}
ASKS = ["Write a short story about a lighthouse.", "Describe a walk in the forest.", "Tell me about the sea.",
        "Write a letter to a friend.", "Describe your favourite city.", "Tell a story about a robot.",
        "Describe a summer day.", "Write about an old library."]


def add_parser(bench_sub, add_engine_args) -> None:
    p = bench_sub.add_parser("structured", help="grammar-constrained decoding: the mask's cost per step")
    add_engine_args(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per run")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration; the median counts")
    p.add_argument("--grammars", default=",".join(GRAMMARS), help=f"comma-separated, of {', '.join(GRAMMARS)}")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=run)


@contextmanager
def _timed_mask(totals: dict[str, float]):
    """Clocks around the three pieces of the mechanism, on the module attributes the engine calls."""
    originals = [(llm_engine, "masks", "fill"), (sampler, "apply_mask", "apply"), (GrammarState, "sync", "accept")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in originals]

    def wrap(fn, part):
        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals[part] = totals.get(part, 0.0) + time.perf_counter() - t
        return timed

    for (obj, name, part), (_, _, fn) in zip(originals, saved):
        setattr(obj, name, wrap(fn, part))
    try:
        yield
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)


def run_once(engine, prompts: list[str], steps: int, spec: StructuredOutputsParams | None) -> dict:
    ids = [f"bench-{i}" for i in range(len(prompts))]
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        engine.add_request(rid, prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=steps + 8, ignore_eos=True,
                                                       structured_outputs=spec))
    started: set[str] = set()
    while engine.has_unfinished() and not started >= set(ids):  # prefill and the first token are not timed
        started |= {o.request_id for o in engine.step() if any(c.token_ids for c in o.outputs)}
    totals: dict[str, float] = {}
    batch_sizes = []
    with _timed_mask(totals):
        t = time.perf_counter()
        for _ in range(steps):
            batch_sizes.append(len(engine.scheduler.running))
            engine.step()
        seconds = time.perf_counter() - t
    for rid in ids:
        engine.abort(rid)
    return {"step_ms": seconds / steps * 1e3, "mean_batch": sum(batch_sizes) / len(batch_sizes),
            **{f"{part}_ms": totals.get(part, 0.0) / steps * 1e3 for part in ("fill", "apply", "accept")}}


def run(args) -> int:
    from engine_service.engine.flags import engine_config_from_args
    from engine_service.engine.llm import LLM

    names = [g for g in args.grammars.split(",") if g]
    if unknown := [g for g in names if g not in GRAMMARS]:
        raise ValueError(f"grammars: unknown {', '.join(unknown)}; expected some of {', '.join(GRAMMARS)}")
    llm = LLM(config=engine_config_from_args(args))
    engine = llm.engine
    prompts = [llm.apply_chat_template([{"role": "user", "content": ASKS[i % len(ASKS)]}]) for i in range(args.batch)]
    run_once(engine, prompts, 2, None)  # warm-up at the batch's shapes
    for name in names:  # the grammar compiler, and each grammar compiled before any timing
        run_once(engine, prompts[:1], 1, GRAMMARS[name])
    res = {"model": args.model, "dtype": engine.config.dtype, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "batch": args.batch, "steps": args.steps,
           "repeats": args.repeats, "target_fraction": TARGET_FRACTION, "runs": {}}
    configs = {"unconstrained": None, **{name: GRAMMARS[name] for name in names}}
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.repeats):  # round-robin: a slow spell of the machine hits every configuration alike
        for name, spec in configs.items():
            runs[name].append(run_once(engine, prompts, args.steps, spec))
    for name, rs in runs.items():
        res["runs"][name] = {key: median([r[key] for r in rs]) for key in rs[0]}
    base = res["runs"]["unconstrained"]["step_ms"]
    for name in names:
        r = res["runs"][name]
        r["mask_ms"] = r["fill_ms"] + r["apply_ms"] + r["accept_ms"]
        r["mask_fraction"] = r["mask_ms"] / base
        r["step_overhead"] = r["step_ms"] / base - 1
        r["within_target"] = r["mask_fraction"] <= TARGET_FRACTION
    for name, r in res["runs"].items():
        extra = "" if name == "unconstrained" else (
            f"  mask {r['mask_ms']:.2f} ms (fill {r['fill_ms']:.2f}, apply {r['apply_ms']:.2f}, accept "
            f"{r['accept_ms']:.2f}) = {100 * r['mask_fraction']:.1f}% of a step")
        print(f"{name:>16}: {r['step_ms']:7.2f} ms/step (batch {r['mean_batch']:.1f}){extra}", flush=True)
    write_with_plot("structured", res, args.out, plot)
    return 0


def plot(res: dict, path) -> None:
    plt = pyplot()

    names = list(res["runs"])
    runs = [res["runs"][n] for n in names]
    mask = [r.get("mask_ms", 0.0) for r in runs]
    rest = [r["step_ms"] - m for r, m in zip(runs, mask)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(names, rest, label="the rest of the step", color="#9aa5b1")
    ax.bar(names, mask, bottom=rest, label="grammar mask (fill + apply + accept)", color="#d9534f")
    for i, r in enumerate(runs):
        if "mask_fraction" in r:
            ax.text(i, r["step_ms"], f"{100 * r['mask_fraction']:.1f}%", ha="center", va="bottom")
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"Structured outputs: step time at batch {res['batch']} ({res['model']}, {res['threads']} threads)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

"""Where one engine step's time goes: linears, attention, sampler, the rest.

`step_breakdown(engine, requests)` adds the requests, runs the engine until every one of them has its
first token (prefill and warm-up are not counted), then times `steps` decode steps, reading a clock
around the pieces, wrapped on this engine instance for the measurement only:

  linears    every Linear of the decoder and the LM head (compute_logits)
  attention  each layer's paged attention call (KV store + decode / prefill kernels)
  layers     the decoder stack as one C call, where a decode step takes it (models/fused_decode.py): its
             embedding, linears, attention, layer ops and final norm are not split further
  model_rest the forward minus those: embedding, RMSNorms, RoPE, SiLU x up, residual adds
  prepare    the model runner's batch tensors (token ids, positions, slot mapping, block tables)
  sampler    sampling (_sample), speculative verification (_verify) and beam steps (_beam_step), with
             their Python: processors, top-k / top-p, log-probs, noise, beam bookkeeping
  rest       the step minus all the above: scheduler, proposers, detokenizer, outputs, Python

Each timed call costs ~1-2 us of its own (under 1 ms per SmolLM2 step). On CUDA every boundary
synchronizes the device, which removes overlap: use it to rank costs, not as a latency figure.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch

from engine_service.engine.models.packed_linear import Linear

PARTS = ("linears", "attention", "layers", "model_rest", "prepare", "sampler", "rest")
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


class _Clock:
    def __init__(self, device: torch.device, clock: str):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.read = CLOCKS[clock]
        self.totals: dict[str, float] = defaultdict(float)
        self.rows = 0  # tokens through the model

    def now(self) -> float:
        self.sync()
        return self.read()

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            t = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[part] += self.now() - t
        return timed


@contextlib.contextmanager
def _instrumented(engine, clock: _Clock):
    """Timing wrappers on this engine's model, runner and sampling calls, removed on exit."""
    runner, model = engine.runner, engine.runner.model
    undo = []

    def patch(obj, name: str, part: str) -> None:
        own = name in vars(obj)  # an instance attribute to put back, or a method to unshadow
        original = getattr(obj, name)
        setattr(obj, name, clock.wrap(part, original))
        undo.append(lambda: setattr(obj, name, original) if own else delattr(obj, name))

    starts: dict[int, float] = {}

    def before(module, args):
        starts[id(module)] = clock.now()

    def after(module, args, out):
        clock.totals["linears"] += clock.now() - starts.pop(id(module))

    for m in model.layers.modules():
        if isinstance(m, Linear):
            undo += [m.register_forward_pre_hook(before).remove, m.register_forward_hook(after).remove]
    for layer in model.layers:
        patch(layer.self_attn, "attn", "attention")
    if getattr(model, "fused_decode", None):  # built by the warm-up's decode steps where it applies
        patch(model.fused_decode, "run", "layers")
    patch(model, "compute_logits", "head")
    patch(runner, "forward", "forward")
    prepare = runner.prepare

    def timed_and_counted(batch):
        t = clock.now()
        inputs = prepare(batch)
        clock.totals["prepare"] += clock.now() - t
        clock.rows += inputs[0].shape[0]
        return inputs

    runner.prepare = timed_and_counted
    undo.append(lambda: delattr(runner, "prepare"))
    for name in ("_sample", "_verify", "_beam_step"):
        patch(engine, name, "sampler")
    try:
        yield
    finally:
        for fn in reversed(undo):
            fn()


def _warm_up(engine, ids: list[str]) -> None:
    """Step until every request has produced a token (prefill, beam forks), then once more."""
    started: set[str] = set()
    while engine.has_unfinished() and not started >= set(ids):
        for out in engine.step():
            if any(o.token_ids for o in out.outputs):
                started.add(out.request_id)
    engine.step()


def step_breakdown(engine, requests: list[tuple], steps: int = 16, clock: str = "wall") -> dict:
    """Mean ms per decode step of `engine` running `requests` [(request_id, prompt, SamplingParams)], split
    into the parts of the module docstring (`<part>_ms`, summing to `step_ms`), with `steps` (how many were
    timed) and `rows_per_step` (tokens through the model). The requests are aborted afterwards.
    clock="cpu" reads the process's CPU time instead of the wall clock: with one torch thread on a busy
    machine it leaves out the time other processes held the core (with more threads it adds theirs up)."""
    if clock not in CLOCKS:
        raise ValueError(f"clock: expected one of {', '.join(CLOCKS)}, got {clock!r}")
    ids = [rid for rid, _, _ in requests]
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    _warm_up(engine, ids)
    timer, timed, total = _Clock(engine.runner.device, clock), 0, 0.0
    try:
        with _instrumented(engine, timer):
            for _ in range(steps):
                if not engine.has_unfinished():
                    break
                t = timer.now()
                engine.step()
                total += timer.now() - t
                timed += 1
    finally:
        for rid in ids:
            engine.abort(rid)
    if not timed:
        return {"steps": 0}
    ms = {k: v * 1e3 / timed for k, v in timer.totals.items()}
    out = {"steps": timed, "rows_per_step": timer.rows / timed, "step_ms": total * 1e3 / timed,
           "linears_ms": ms.get("linears", 0.0) + ms.get("head", 0.0), "attention_ms": ms.get("attention", 0.0),
           "layers_ms": ms.get("layers", 0.0),
           "model_rest_ms": ms.get("forward", 0.0) - ms.get("linears", 0.0) - ms.get("attention", 0.0)
           - ms.get("layers", 0.0),
           "prepare_ms": ms.get("prepare", 0.0), "sampler_ms": ms.get("sampler", 0.0)}
    out["rest_ms"] = out["step_ms"] - sum(out[f"{p}_ms"] for p in PARTS if p != "rest")
    return out

"""One request's failure ends that request only.

The per-request parts of a step (sampling, speculative verification, the beam processors) run over
the whole batch at once. An exception there (say NaN probabilities from one request's parameters)
would take every request down. `run_isolated` runs the batch; if it raises, it puts back what the
attempt may have changed (draft tokens, seeded generators, speculative counters) and runs each
request's items alone: a request that raises again is failed, the others get the results they would
have had in the batch (a seeded draw restarts from the same generator state).
"""
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from engine_service.engine.sequence import Request, Sequence

Item = TypeVar("Item", bound=tuple)  # (sequence, its rows of the step's logits)


@dataclass
class _Saved:
    """What a batched attempt may change in one sequence before it raises."""

    seq: Sequence
    drafts: list[int]
    generator_state: torch.Tensor | None

    @classmethod
    def of(cls, seq: Sequence) -> "_Saved":
        drafts = seq.token_ids[seq.num_tokens - seq.num_draft_tokens:] if seq.num_draft_tokens else []
        state = seq.generator.get_state() if seq.generator is not None else None
        return cls(seq, drafts, state)

    def restore(self) -> None:
        seq = self.seq
        del seq.token_ids[seq.num_tokens - seq.num_draft_tokens:]
        seq.token_ids += self.drafts
        seq.num_draft_tokens = len(self.drafts)
        if self.generator_state is not None:
            seq.generator.set_state(self.generator_state)


def run_isolated(items: list[Item], run: Callable[[list[Item]], list[Any]],
                 fail: Callable[[Request, Exception], None], counters: list | None = None
                 ) -> list[tuple[Item, Any]]:
    """run(items) -> one result per item, in order. Returns (item, result) for every item whose request
    did not fail; `counters` are objects whose plain fields a failed batched attempt must not keep."""
    saved = [_Saved.of(item[0]) for item in items]
    kept = [(obj, dict(vars(obj))) for obj in counters or []]
    try:
        return list(zip(items, run(items)))
    except Exception:
        for s in saved:
            s.restore()
        for obj, fields in kept:
            vars(obj).update(fields)
    groups: dict[int, list[Item]] = {}
    for item in items:
        groups.setdefault(id(item[0].request), []).append(item)
    done = []
    for group in groups.values():
        try:
            done += zip(group, run(group))
        except Exception as e:  # this request's own input raised: it ends, the batch goes on
            fail(group[0][0].request, e)
    return done

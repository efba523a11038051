"""The sampler pipeline, per token (SamplingParams.sampler_stages): a row's distribution after each processor that
changed it, taken from the very tensors process_logits computes, for the rows that ask only.

process_logits hands a Tracer each stage's logits (sampler.process_logits, in its order: raw, grammar mask,
penalties = logit bias + repetition + presence/frequency + the min_tokens EOS ban, temperature, top-k, top-p, min-p)
with the batch rows the stage acted on; the tracer copies the asked rows. After the draw, `summarize` reduces each
copy to a StageRecord: the top-N (id, probability), the tokens kept (finite logits), the probability of the row's
previous stage that this one removed, and the chosen token's rank and probability. A batch where no row asks builds
no Tracer: process_logits and sample() then run exactly as without this module.
"""
from dataclasses import asdict, dataclass, field

import torch

STAGES = ("raw", "grammar", "penalties", "temperature", "top_k", "top_p", "min_p")


@dataclass
class StageRecord:
    name: str  # one of STAGES
    top: list[tuple[int, float]]  # the N most likely (id, probability), best first; tokens of probability 0 left out
    kept: int  # tokens with a finite logit
    removed: float  # probability (of the row's previous stage) on the tokens this stage removed
    other: float  # probability on the kept tokens outside `top`
    chosen_rank: int  # of the drawn token: how many tokens have a larger logit (0: the most likely)
    chosen_prob: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Tracer:
    """Per stage, the traced rows' logits after it and which of them it acted on."""

    rows: list[int]  # batch rows that asked (SamplingBatch.stages > 0)
    top_n: list[int]  # per traced row: how many tokens each stage reports
    snaps: list[tuple[str, set[int], torch.Tensor]] = field(default_factory=list)  # (stage, acted rows, [R, V])

    def record(self, name: str, logits: torch.Tensor, acted: list[int] | None = None) -> None:
        """Copy the traced rows of `logits` (the batch's) after stage `name`; `acted`: the batch rows it changed
        (None: all). A stage that acted on no traced row is not kept."""
        assert name in STAGES, name
        touched = set(self.rows) if acted is None else set(acted) & set(self.rows)
        if touched or name == "raw":
            self.snaps.append((name, touched, logits[self.rows].float()))  # list indexing copies

    def summarize(self, tokens: torch.Tensor) -> list[list[StageRecord] | None]:
        """Per batch row of `tokens` (the drawn ids): its stages, raw first; None for a row that did not ask."""
        out: list[list[StageRecord] | None] = [None] * tokens.shape[0]
        chosen = tokens[self.rows].tolist()
        for i, row in enumerate(self.rows):
            stages: list[StageRecord] = []
            prev: torch.Tensor | None = None
            for name, touched, snap in self.snaps:
                if name != "raw" and row not in touched:
                    continue
                probs = snap[i].softmax(dim=0)
                stages.append(_stage(name, snap[i], probs, prev, chosen[i], self.top_n[i]))
                prev = probs
            out[row] = stages
        return out


def _stage(name: str, logits: torch.Tensor, probs: torch.Tensor, prev: torch.Tensor | None, token: int,
           n: int) -> StageRecord:
    finite = logits.isfinite()
    kept = int(finite.sum())
    values, ids = probs.topk(min(n, kept))
    top = [(t, p) for t, p in zip(ids.tolist(), values.tolist()) if p > 0]
    removed = float(prev[~finite].sum()) if prev is not None else 0.0
    chosen_rank = int((logits > logits[token]).sum())
    return StageRecord(name, top, kept, removed, max(0.0, 1.0 - sum(p for _, p in top)), chosen_rank,
                       float(probs[token]))

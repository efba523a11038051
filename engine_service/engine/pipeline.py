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

from decodelab_kernels import cpu_logits

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


# A traced row after a stage: its logits [V] (dense), or only its kept tokens (ids [K], logits [K]) where the stage
# itself produced them that way (the fused top-k / top-p step): no [V] copy, no pass over the vocabulary.
Snap = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


@dataclass
class Tracer:
    """Per stage, the traced rows it acted on, each with its logits after it."""

    rows: list[int]  # batch rows that asked (SamplingBatch.stages > 0)
    top_n: list[int]  # per traced row: how many tokens each stage reports
    snaps: list[tuple[str, dict[int, Snap]]] = field(default_factory=list)  # (stage, batch row -> its snap)

    def record(self, name: str, logits: torch.Tensor, acted: list[int] | None = None) -> None:
        """Copy the traced rows of `logits` (the batch's) that stage `name` acted on (`acted`: the batch rows it
        changed, None: all); raw keeps every traced row. A stage that acted on no traced row is not kept."""
        assert name in STAGES, name
        acted_set = None if acted is None or name == "raw" else set(acted)
        touched = self.rows if acted_set is None else [r for r in self.rows if r in acted_set]
        if touched:
            self.snaps.append((name, {r: logits[r].clone() for r in touched}))

    def record_kept(self, name: str, rows: list[int], ids: torch.Tensor, logits: torch.Tensor) -> None:
        """As record, for a stage that gives its rows' kept tokens: batch rows `rows`, ids / logits [len(rows), K]
        (entries of -inf are not kept)."""
        assert name in STAGES, name
        traced = set(self.rows)
        kept = {r: (ids[i], logits[i]) for i, r in enumerate(rows) if r in traced}
        if kept:
            self.snaps.append((name, {r: (i[v.isfinite()], v[v.isfinite()]) for r, (i, v) in kept.items()}))

    def summarize(self, tokens: torch.Tensor) -> list[list[StageRecord] | None]:
        """Per batch row of `tokens` (the drawn ids): its stages, raw first; None for a row that did not ask."""
        out: list[list[StageRecord] | None] = [None] * tokens.shape[0]
        chosen = tokens.tolist()
        for i, row in enumerate(self.rows):
            stages: list[StageRecord] = []
            prev: _Dist | None = None
            for name, by_row in self.snaps:
                if row in by_row:
                    record, prev = _stage(name, by_row[row], prev, chosen[row], self.top_n[i])
                    stages.append(record)
            out[row] = stages
        return out


@dataclass
class _Dist:
    """A stage's distribution as the next one needs it: probability exp(logit - lse) on its kept tokens."""
    ids: torch.Tensor | None  # the kept tokens; None: logits is the whole vocabulary
    logits: torch.Tensor
    lse: torch.Tensor
    kept: int

    def mass(self, ids: torch.Tensor) -> float:
        """The probability of `ids` (some may not be kept: probability 0)."""
        if self.ids is None:
            return float((self.logits[ids] - self.lse).exp_().sum())
        return float((self.logits[torch.isin(self.ids, ids)] - self.lse).exp_().sum())


def _stage(name: str, snap: Snap, prev: _Dist | None, token: int, n: int) -> tuple[StageRecord, _Dist]:
    # a dense stage in C where it has no -inf (cpu_logits: log-sum-exp and top-n in two passes), a cut one on its
    # kept tokens only (~50 of 49k); raw and temperature remove no token, so they count none
    if isinstance(snap, tuple):
        # in token order, as a dense stage's kept tokens are: the fused step gives them in its topk's order, whose
        # ties fall by the batch's shape, and the top-n below takes tied tokens by position
        ids, sub = snap
        order = ids.argsort()
        ids, sub = ids[order], sub[order]
    else:
        vocab, finite = snap.shape[0], None
        if name in ("raw", "temperature"):
            kept = vocab if prev is None else prev.kept
        else:
            finite = snap.isfinite()
            kept = int(finite.sum())
        if kept == vocab:
            return _full_stage(name, snap, prev, token, n)
        ids = (snap.isfinite() if finite is None else finite).nonzero().flatten()
        sub = snap[ids]
    lse = sub.logsumexp(0)
    kept = ids.numel()
    values, at = (sub - lse).exp_().topk(min(n, kept))
    hit = (ids == token).nonzero().flatten()
    chosen = sub[hit[0]] if hit.numel() else torch.tensor(float("-inf"))
    removed = 1.0 - prev.mass(ids) if prev is not None else 0.0
    return _record(name, ids[at], values, kept, removed, int((sub > chosen).sum()), chosen - lse), \
        _Dist(ids, sub, lse, kept)


def _full_stage(name: str, logits: torch.Tensor, prev: _Dist | None, token: int,
                n: int) -> tuple[StageRecord, _Dist]:
    vocab = logits.shape[0]
    if cpu_logits.applies(logits[None]):
        lse_, _, top_ids, top_lp = cpu_logits.logit_stats(logits[None], min(n, vocab))
        lse, ids, values = lse_[0], top_ids[0], top_lp[0].exp()
    else:
        lse = logits.logsumexp(0)
        values, ids = (logits - lse).exp_().topk(min(n, vocab))
    rank = int((logits > logits[token]).sum())
    return _record(name, ids, values, vocab, 0.0, rank, logits[token] - lse), _Dist(None, logits, lse, vocab)


def _record(name: str, ids: torch.Tensor, values: torch.Tensor, kept: int, removed: float, rank: int,
            chosen_lp: torch.Tensor) -> StageRecord:
    top = [(t, p) for t, p in zip(ids.tolist(), values.tolist()) if p > 0]
    return StageRecord(name, top, kept, max(0.0, removed), max(0.0, 1.0 - sum(p for _, p in top)), rank,
                       float(chosen_lp.exp()))

"""Vectorised sampling over the batch, processors in Hugging Face's order:
logit_bias -> repetition penalty -> presence / frequency penalties -> (min_tokens EOS mask) -> temperature
-> top-k -> top-p -> min-p. (vLLM adds logit_bias before its penalties too; OpenAI's presence and frequency
penalties count the generated tokens only, HF's repetition penalty the prompt as well.)

Rows that ask for their sampler pipeline (SamplingParams.sampler_stages) get each stage's distribution from these
tensors (pipeline.Tracer); a batch where none asks builds no tracer.

Seeded rows draw their noise from their own generator, so a seeded request gives the same tokens
whatever else is in the batch (the exponential-race trick: argmax(p / E), E ~ Exp(1), samples p).
"""
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import torch

from decodelab_kernels import cpu_logits
from engine_service.engine.pipeline import StageRecord, Tracer
from engine_service.engine.sampling_params import SAMPLING_EPS, SamplingParams
from engine_service.engine.structured import GrammarMask, apply_mask, masked_mass


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [S] (below SAMPLING_EPS, 0 included = greedy)
    top_k: torch.Tensor  # [S] int (<= 0 disabled)
    top_p: torch.Tensor  # [S]
    min_p: torch.Tensor  # [S]
    repetition_penalty: torch.Tensor  # [S]
    seen_tokens: torch.Tensor | None  # [S, T] int64 prompt + output ids padded with -1 (penalty rows only)
    banned_tokens: list[list[int]]  # per row: ids masked this step (EOS before min_tokens)
    generators: list[torch.Generator | None]
    num_logprobs: int  # max top-N logprobs asked by any row
    output_tokens: torch.Tensor | None = None  # [S, T] int64 generated ids padded with -1 (presence/frequency)
    presence_penalty: torch.Tensor | None = None  # [S], with output_tokens
    frequency_penalty: torch.Tensor | None = None  # [S], with output_tokens
    logit_bias: list[dict[int, float]] | None = None  # per row: token id -> bias
    grammar: GrammarMask | None = None  # structured outputs: the allowed tokens of the constrained rows
    entropy: bool = False  # some row asked for logprobs: report each row's entropy too (else no cost)
    stages: list[int] | None = None  # per row: top-N of its sampler pipeline (0: none); None when no row asks

    @property
    def writes_logits(self) -> bool:
        """Whether process_logits writes into the tensor it is given (banned tokens, a grammar's mask): callers
        that keep reading those logits pass a copy then."""
        return any(self.banned_tokens) or self.grammar is not None

    @classmethod
    def of(cls, seqs: list, stop_ids: Callable[[SamplingParams], set[int]]) -> "SamplingBatch":
        """One row per sequence (or proposer Context) from its request's params; its stop tokens are
        banned until min_tokens are out."""
        ps = [s.request.params for s in seqs]
        seen = None
        if any(p.repetition_penalty != 1.0 for p in ps):
            width = max(s.num_tokens for s in seqs)
            seen = torch.tensor([s.token_ids + [-1] * (width - s.num_tokens) for s in seqs], dtype=torch.int64)
        outputs = presence = frequency = None
        if any(p.presence_penalty or p.frequency_penalty for p in ps):
            generated = [s.token_ids[s.num_tokens - s.num_output_tokens:] for s in seqs]
            width = max(1, max(map(len, generated)))
            outputs = torch.tensor([g + [-1] * (width - len(g)) for g in generated], dtype=torch.int64)
            presence = torch.tensor([float(p.presence_penalty) for p in ps])
            frequency = torch.tensor([float(p.frequency_penalty) for p in ps])
        # the float columns as the rows of one tensor (each contiguous): a torch.tensor call costs ~8 us, and this
        # runs every step
        temperature, top_p, min_p, repetition_penalty = torch.tensor([
            [0.0 if p.greedy else p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps],
            [p.repetition_penalty for p in ps]])
        return cls(
            temperature=temperature,
            top_k=torch.tensor([p.top_k for p in ps]),
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            seen_tokens=seen,
            banned_tokens=[sorted(stop_ids(p)) if s.num_output_tokens < p.min_tokens else []
                           for s, p in zip(seqs, ps)],
            generators=[s.generator for s in seqs],
            num_logprobs=max(p.logprobs or 0 for p in ps),
            output_tokens=outputs, presence_penalty=presence, frequency_penalty=frequency,
            logit_bias=[p.logit_bias or {} for p in ps] if any(p.logit_bias for p in ps) else None,
            entropy=any(p.logprobs is not None for p in ps),
            stages=[p.sampler_stages for p in ps] if any(p.sampler_stages for p in ps) else None,
        )

    def to(self, device: torch.device) -> "SamplingBatch":
        """The per-row tensors on the logits' device (the engine builds them on the CPU)."""
        if self.temperature.device == device:
            return self
        optional = ("seen_tokens", "output_tokens", "presence_penalty", "frequency_penalty")
        return replace(self, **{name: getattr(self, name).to(device) for name in (
            "temperature", "top_k", "top_p", "min_p", "repetition_penalty")},
            **{name: None if getattr(self, name) is None else getattr(self, name).to(device) for name in optional})

    def take(self, rows: list[int]) -> "SamplingBatch":
        """The batch of these rows only: every per-row tensor and list indexed, the batch-wide fields (num_logprobs,
        entropy) kept, so outputs of parts of a batch have the same shapes. Not for a batch with a grammar (its
        masks are laid out by row)."""
        assert self.grammar is None
        idx = torch.tensor(rows, dtype=torch.int64)

        def pick(v):
            if isinstance(v, torch.Tensor):
                return v[idx.to(v.device)]
            return [v[r] for r in rows] if isinstance(v, list) else v

        return replace(self, **{f.name: pick(getattr(self, f.name)) for f in fields(self)})


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    logprobs: torch.Tensor  # [S] raw logprob of the chosen token
    top_ids: torch.Tensor | None  # [S, N]
    top_logprobs: torch.Tensor | None  # [S, N]
    entropy: torch.Tensor | None = None  # [S] nats, of the raw distribution (SamplingBatch.entropy)
    # with SamplingBatch.entropy and a grammar: per row, the raw probability its mask removed (None: unconstrained)
    masked: list[float | None] | None = None
    # with SamplingBatch.stages: per row, its sampler pipeline (pipeline.py); None for a row that did not ask
    stages: list[list[StageRecord] | None] | None = None

    def rows(self, num_logprobs: list[int | None]) -> list[tuple[int, float, dict[int, float] | None]]:
        """Per row: (token, its log-prob, its top num_logprobs[row] {id: log-prob}, None when 0 or None)."""
        out = []
        for i, (token, logprob, k) in enumerate(zip(self.token_ids.tolist(), self.logprobs.tolist(), num_logprobs)):
            top = None
            if self.top_ids is not None and k:
                top = dict(zip(self.top_ids[i, :k].tolist(), self.top_logprobs[i, :k].tolist()))
            out.append((token, logprob, top))
        return out


# where an extreme penalty takes a finite logit at most: still finite after the smallest temperature divides it
# (1e30 / SAMPLING_EPS < float32's 3.4e38), so no +inf (and no NaN after softmax) reaches a draw
PENALISED_BOUND = 1e30


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    # a mask, not gather/scatter: padding (-1) scattered onto a real id could overwrite its penalty
    vocab = logits.shape[1]
    mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, torch.where(seen >= 0, seen, vocab), True)
    # a penalty below float32's range (5e-324 passes validation) would be 0: logits / 0 = inf, 0 / 0 = NaN
    p = penalty[:, None].clamp(min=torch.finfo(logits.dtype).tiny)
    penalised = torch.where(logits < 0, logits * p, logits / p).clamp(-PENALISED_BOUND, PENALISED_BOUND)
    # a masked (-inf) logit stays masked: a grammar's or min_tokens' ban is not the penalty's to lift
    return torch.where(mask[:, :vocab] & logits.isfinite(), penalised, logits)


def apply_presence_frequency(logits: torch.Tensor, outputs: torch.Tensor, presence: torch.Tensor,
                             frequency: torch.Tensor) -> torch.Tensor:
    # counts by scatter_add into one spare column where the padding (-1) goes
    vocab = logits.shape[1]
    counts = torch.zeros(logits.shape[0], vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, torch.where(outputs >= 0, outputs, vocab), torch.ones_like(outputs, dtype=logits.dtype))
    counts = counts[:, :vocab]
    return logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, bias: list[dict[int, float]]) -> torch.Tensor:
    added = torch.zeros_like(logits)
    for row, by_token in enumerate(bias):
        if by_token:
            added[row, list(by_token)] = torch.tensor(list(by_token.values()), dtype=logits.dtype,
                                                      device=logits.device)
    return logits + added


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1). CPU float32 rows go through NumPy: the same index (the first maximum; a NaN before any
    number) at ~6 us a 49k row, where torch's CPU argmax took ~100 us on the 2-core target."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return torch.from_numpy(np.asarray(x.detach().numpy().argmax(axis=-1), dtype=np.int64))
    return x.argmax(dim=-1)


def topk_rows(x: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(n, dim=-1) of rows x [S, V] -> (values, ids), largest first. Where our CPU kernel applies
    (cpu_logits.applies) and n <= 512, one C pass: ~35-60 us a 49k row against torch.topk's 130-160 on the 2-core
    target; equal values come lowest id first (torch.topk leaves their order open)."""
    if 0 < n <= 512 and cpu_logits.applies(x):
        ids = cpu_logits.logit_stats(x, n)[2]
        return x.gather(1, ids), ids
    return x.topk(n, dim=-1)


def entropy_topk_rows(logprobs: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(entropy(logprobs), *topk_rows(logprobs, n)) of log-prob rows [S, V], n >= 1: one C pass where our kernel
    applies, whose entropy does not depend on n (the same bits as entropy()'s) and whose top-n is topk_rows'."""
    if n <= 512 and cpu_logits.applies(logprobs):
        _, ent, ids, _ = cpu_logits.logit_stats(logprobs, n)
        return ent, logprobs.gather(1, ids), ids
    return entropy(logprobs), *topk_rows(logprobs, n)


def finite_ids(row: torch.Tensor) -> torch.Tensor:
    """The ids of a 1-D row's finite entries, ascending (NumPy on the CPU: ~60 us a 49k row against ~270)."""
    if row.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(np.isfinite(row.detach().numpy())))
    return row.isfinite().nonzero().flatten()


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # top_k may stay on the CPU: its max sizes the topk without a device sync
    k = torch.where(top_k > 0, top_k, logits.shape[1]).clamp_max(logits.shape[1])
    kth = logits.topk(int(k.max()), dim=1).values.gather(1, (k - 1)[:, None].to(logits.device))
    return logits.masked_fill(logits < kth, float("-inf"))


def top_k_top_p_kept(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k, then top-p (a row with top_p >= 1 skips it), for CPU rows that all have a top-k (top_k [S] > 0): the
    top-p cut is found among each row's k largest logits, sorted, instead of sorting the vocabulary (49k logits:
    ~4 ms a row on one core of the 2-core target). Returns (ids [S, w], their logits after top-k [S, w], after
    top-p [S, w], -inf where cut, w the largest k, largest first; tied [S]): the tokens the two steps keep (HF's,
    up to float rounding in the cumulative sum), except on a `tied` row, one with ties across its k-th largest
    logit (top-k then keeps more than k tokens), which the caller takes through the two steps. A row's result
    does not depend on the others' k (the cumulative sum runs over its own k, below)."""
    k = top_k.to(logits.device)
    width = int(top_k.max())
    # one more than the widest k: a row ties across its k-th largest logit iff its (k+1)-th equals it
    values, ids = topk_rows(logits, min(width + 1, logits.shape[1]))  # descending
    kth = values.gather(1, (k - 1)[:, None])[:, 0]
    beyond = k < values.shape[1]  # rows with a (k+1)-th logit
    tied = beyond & (values.gather(1, torch.where(beyond, k, k - 1)[:, None])[:, 0] == kth)
    values, ids = values[:, :width], ids[:, :width]
    beyond_k = torch.arange(values.shape[1], device=logits.device) >= k[:, None]
    values = values.masked_fill(beyond_k, float("-inf"))
    # HF's top-p on the ascending order, the tokens top-k removed first with probability 0: a running sum from the
    # left (a softmax's sum would group the terms by position, so another row's wider k could move the cut)
    e = (values.flip(1) - values[:, :1]).exp()
    cum = e.cumsum(dim=1)
    cum = cum / cum[:, -1:]
    drop = (cum <= (1 - top_p.to(logits.device))[:, None]) & (top_p < 1).to(logits.device)[:, None]
    drop[:, -1] = False
    return ids, values, values.masked_fill(drop.flip(1), float("-inf")), tied


def _on_rows(logits: torch.Tensor, rows: list[int], fn) -> torch.Tensor:
    """`fn` applied to the given rows of `logits` (a tensor of this step's own: written in place)."""
    if len(rows) == logits.shape[0]:
        return fn(logits)
    if rows:
        logits[rows] = fn(logits[rows])
    return logits


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # HF: sort ascending, drop the tokens whose cumulative probability stays <= 1 - top_p, keep >= 1
    sorted_logits, order = logits.sort(dim=1)
    cum = sorted_logits.softmax(dim=1).cumsum(dim=1)
    drop = cum <= (1 - top_p)[:, None]
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def apply_top_p_partial(logits: torch.Tensor, top_p: torch.Tensor, first_k: int = 64) -> torch.Tensor:
    """apply_top_p without sorting the vocabulary, for a CPU (a 49k-token sort: ~5.6 ms a row on the 2-core target,
    so 8 streams sampling with top_p alone spent ~30 ms a step on it). HF keeps a token while the probability
    ranked above it is below top_p; when a row's k largest logits (sorted) hold at least top_p of its mass, its
    cut lies among them. k starts at `first_k` and grows 8x for the rows whose k do not hold it (or hold it within
    1e-4, where float rounding could move the cut past k); past a quarter of the vocabulary a row is sorted as
    apply_top_p does, and so is a row whose cut falls within 1e-5 of top_p (HF's float32 cumulative sum over the
    whole vocabulary, ~1e-5 off over 49k tokens, decides those). So the same tokens as HF's."""
    out, lse = torch.full_like(logits, float("-inf")), None
    pending, k = list(range(logits.shape[0])), first_k
    while pending:
        if k > logits.shape[1] // 4:  # a flat row: sorting costs no more than more rounds of topk
            out[pending] = apply_top_p(logits[pending], top_p[pending])
            break
        x = logits[pending]
        if k <= 512 and cpu_logits.applies(x):  # the k largest and the log-sum-exp in two C passes
            _, _, ids, logprobs = cpu_logits.logit_stats(x, k)
            values, probs = x.gather(1, ids), logprobs.exp()
        else:
            lse = logits.logsumexp(dim=1, keepdim=True) if lse is None else lse
            values, ids = x.topk(k, dim=1)
            probs = (values - lse[pending]).exp()
        above = probs.cumsum(dim=1) - probs  # the mass ranked above each of the k
        p = top_p[pending][:, None]
        keep = above < p  # the most likely token always (nothing above it; top_p > 0)
        held = (above[:, -1:] + probs[:, -1:] >= p + 1e-4).flatten().tolist()
        # a boundary within 1e-5 of top_p: HF's float32 sum over the whole vocabulary decides it (the sort)
        near = ((above - p).abs() < 1e-5).any(dim=1).tolist()
        sort = [r for r, h, n in zip(pending, held, near) if h and n]
        if sort:
            out[sort] = apply_top_p(logits[sort], top_p[sort])
        done = [i for i, (h, n) in enumerate(zip(held, near)) if h and not n]
        if done:
            kept = values[done].masked_fill(~keep[done], float("-inf"))
            out[[pending[i] for i in done]] = kept.new_full((len(done), logits.shape[1]), float("-inf")).scatter_(
                1, ids[done], kept)
        pending, k = [r for r, h in zip(pending, held) if not h], k * 8
    return out


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=1)
    threshold = min_p[:, None] * probs.max(dim=1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(logits: torch.Tensor, b: SamplingBatch, tracer: Tracer | None = None) -> torch.Tensor:
    """Everything HF's processors do before the final softmax (greedy rows keep temperature 1). May return `logits`
    itself when nothing applies (no temperature but 1, no top-k, top-p or min-p): callers must not write to it.
    `tracer` (pipeline.py) copies its rows after each stage (the fused top-k / top-p step hands it both)."""
    # rows and sizes from the batch as built (on the CPU): no device syncs; each processor runs on the rows
    # that ask for it only (a greedy row in the batch costs no top-k / top-p work)
    top_k, top_p, vocab = b.top_k, b.top_p, logits.shape[1]
    k_rows = ((top_k > 0) & (top_k < vocab)).nonzero().flatten().tolist()  # top_k >= vocab keeps every token
    p_rows = (top_p < 1).nonzero().flatten().tolist()
    min_p_rows = (b.min_p > 0).nonzero().flatten().tolist()
    temp_rows = ((b.temperature >= SAMPLING_EPS) & (b.temperature != 1.0)).nonzero().flatten().tolist()
    b = b.to(logits.device)
    if tracer is not None:
        tracer.record("raw", logits)
    if b.grammar is not None:  # first, as vLLM: the processors then act on the tokens the grammar allows
        apply_mask(logits, b.grammar)
        if tracer is not None:
            tracer.record("grammar", logits, b.grammar.rows)
    logits = _penalties(logits, b)
    if tracer is not None:
        tracer.record("penalties", logits, _penalised_rows(b))
    if temp_rows:  # dividing by 1 changes nothing
        logits = logits / torch.where(b.temperature >= SAMPLING_EPS, b.temperature, 1.0)[:, None]
        if tracer is not None:
            tracer.record("temperature", logits, temp_rows)
    elif k_rows or p_rows or min_p_rows:
        logits = logits.clone()  # _on_rows writes its rows in place: never into the caller's tensor
    fused = []  # rows whose top-k and top-p run as one step (each row's own choice: a batch-mate cannot move it)
    if k_rows and logits.device.type == "cpu":  # sorts cost on a CPU, syncs do not
        ids, after_k, kept, tied = top_k_top_p_kept(logits[k_rows], top_k[k_rows], top_p[k_rows])
        ok = [i for i, t in enumerate(tied.tolist()) if not t]
        if ok:
            fused = [k_rows[i] for i in ok]
            if tracer is not None:  # both stages as kept tokens only: the k ids, before and after the top-p cut
                tracer.record_kept("top_k", fused, ids[ok], after_k[ok])
                p_set = set(p_rows)
                cut = [i for i in ok if k_rows[i] in p_set]
                tracer.record_kept("top_p", [k_rows[i] for i in cut], ids[cut], kept[cut])
            cut_logits = torch.full((len(ok), vocab), float("-inf"), dtype=logits.dtype).scatter_(1, ids[ok], kept[ok])
            logits = _on_rows(logits, fused, lambda _: cut_logits)
    k_rows, p_rows = [r for r in k_rows if r not in fused], [r for r in p_rows if r not in fused]
    logits = _on_rows(logits, k_rows, lambda x: apply_top_k(x, top_k[k_rows]))
    if tracer is not None:
        tracer.record("top_k", logits, k_rows)
    top_p_fn = apply_top_p_partial if logits.device.type == "cpu" else apply_top_p  # sorts are cheap on a GPU
    logits = _on_rows(logits, p_rows, lambda x: top_p_fn(x, b.top_p[p_rows]))
    if tracer is not None:
        tracer.record("top_p", logits, p_rows)
    logits = _on_rows(logits, min_p_rows, lambda x: apply_min_p(x, b.min_p[min_p_rows]))
    if tracer is not None:
        tracer.record("min_p", logits, min_p_rows)
    return logits


def _penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """logit_bias, repetition penalty, presence / frequency penalties, then the min_tokens ban, as HF orders them."""
    if b.logit_bias is not None:
        logits = apply_logit_bias(logits, b.logit_bias)
    if b.seen_tokens is not None:
        logits = apply_repetition_penalty(logits, b.seen_tokens, b.repetition_penalty)
    if b.output_tokens is not None:
        logits = apply_presence_frequency(logits, b.output_tokens, b.presence_penalty, b.frequency_penalty)
    for row, banned in enumerate(b.banned_tokens):
        if banned:
            logits[row, banned] = float("-inf")
    return logits


def _penalised_rows(b: SamplingBatch) -> list[int]:
    """The rows _penalties changes (a traced row's pipeline shows the stage only there)."""
    rows = {r for r, banned in enumerate(b.banned_tokens) if banned}
    rows |= {r for r, bias in enumerate(b.logit_bias or []) if bias}
    if b.seen_tokens is not None:  # a penalty with tokens to act on
        rows |= set(((b.repetition_penalty != 1.0) & (b.seen_tokens >= 0).any(dim=1)).nonzero().flatten().tolist())
    if b.output_tokens is not None:
        asked = (b.presence_penalty != 0) | (b.frequency_penalty != 0)
        rows |= set((asked & (b.output_tokens >= 0).any(dim=1)).nonzero().flatten().tolist())
    return sorted(rows)


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """One token per row, with its raw log-prob (and the batch's top-N and entropies where asked). Plain greedy
    rows (plain_rows) take one C pass (_sample_greedy), rows only temperature, top-k and top-p act on (cut_rows)
    race among their k largest logits (_sample_cut), and the rest take the processors; what each row gets does not
    depend on the split (greedy rows draw no noise; a cut row draws the noise _sample_full would)."""
    n = logits.shape[0]
    plain, cut = (plain_rows(b), cut_rows(b, logits.shape[1])) if cpu_logits.applies(logits) else ([], [])
    parts = []  # (rows, their output)
    if plain:
        parts.append((plain, _sample_greedy(logits if len(plain) == n else logits[plain], b)))
    if cut and (out := _sample_cut(logits, b, cut)) is not None:
        parts.append((cut, out))
    taken = {r for rows, _ in parts for r in rows}
    rest = [r for r in range(n) if r not in taken]
    if rest:
        parts.append((rest, _sample_full(logits, b) if not taken else _sample_full(logits[rest], b.take(rest))))
    return parts[0][1] if len(parts) == 1 else _merge(n, parts)


def _sample_full(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    # the raw log-probs' statistics in two C passes where it runs (decodelab_kernels/cpu_logits.c); a grammar's masked
    # mass needs the full log-prob rows
    stats = cpu_logits.logit_stats(logits, b.num_logprobs) if b.grammar is None and cpu_logits.applies(logits) else None
    raw_logprobs = logits.log_softmax(dim=1) if stats is None else None
    tracer = Tracer([r for r, n in enumerate(b.stages) if n], [n for n in b.stages if n]) if b.stages else None
    processed = process_logits(logits.clone() if b.writes_logits else logits, b, tracer)
    rows = (b.temperature >= SAMPLING_EPS).nonzero().flatten().tolist()  # sampled rows (the batch is on the CPU)
    if not rows:
        tokens = argmax_rows(processed)
    else:  # argmax over the greedy rows only (~0.1 ms a 49k row), a race over each sampled row's candidates
        tokens = torch.empty(processed.shape[0], dtype=torch.int64, device=processed.device)
        greedy = (b.temperature < SAMPLING_EPS).nonzero().flatten().tolist()
        if greedy:
            tokens[greedy] = argmax_rows(processed[greedy])
        cut = ((b.top_k > 0) | (b.top_p < 1) | (b.min_p > 0)).tolist()
        for r in rows:
            tokens[r] = _race(processed[r], b.generators[r], cut[r])
    stages = tracer.summarize(tokens) if tracer is not None else None
    if stats is not None:  # logits is unchanged: process_logits wrote to a clone, or to new tensors
        return _from_stats(logits, tokens, stats, b, stages)
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    top_ids = top_lp = None
    if b.num_logprobs > 0:
        top_lp, top_ids = raw_logprobs.topk(b.num_logprobs, dim=1)
    masked = masked_mass(raw_logprobs, b.grammar) if b.entropy and b.grammar is not None else None
    return SamplerOutput(tokens, chosen, top_ids, top_lp, entropy(raw_logprobs) if b.entropy else None, masked,
                         stages)


def plain_rows(b: SamplingBatch) -> list[int]:
    """The rows whose token is the argmax of their raw logits: greedy (no temperature), and nothing process_logits
    runs first can move it: no penalty, bias or min_tokens ban (_penalised_rows, the rows `_penalties` changes), no
    grammar in the batch, no sampler pipeline to trace. Top-k, top-p and min-p keep the largest logit (every one
    of them on a tie), so they cannot."""
    if b.grammar is not None:
        return []
    greedy = [r for r, t in enumerate(b.temperature.tolist()) if t < SAMPLING_EPS]  # (a few rows: no nonzero())
    moved = _moved_rows(b) if greedy else set()
    return [r for r in greedy if r not in moved]


def cut_rows(b: SamplingBatch, vocab: int) -> list[int]:
    """The sampled rows that only the temperature, a top-k (0 < k < vocab) and top-p act on: no penalty, bias or
    min_tokens ban, no min-p, no grammar in the batch, no sampler pipeline to trace (_sample_cut)."""
    if b.grammar is not None:
        return []
    rows = [r for r, (t, k, m) in enumerate(zip(b.temperature.tolist(), b.top_k.tolist(), b.min_p.tolist()))
            if t >= SAMPLING_EPS and 0 < k < vocab and m <= 0]
    moved = _moved_rows(b) if rows else set()
    return [r for r in rows if r not in moved]


def _moved_rows(b: SamplingBatch) -> set[int]:
    """Rows process_logits changes before the temperature (penalties, bias, bans) or traces (sampler_stages)."""
    return set(_penalised_rows(b)) | {r for r, n in enumerate(b.stages or []) if n}


def _sample_greedy(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    """sample() for plain rows (see cpu_logits.applies): one pass set in C gives the argmax (the first of the top
    ids: ties go to the lowest id, as torch.argmax), its log-prob, the top-N and the entropy, with none of
    process_logits' per-row bookkeeping (~0.8 ms of a one-stream step on the 2-core target)."""
    _, ent, ids, lp = cpu_logits.logit_stats(logits, max(1, b.num_logprobs))
    top = b.num_logprobs > 0
    return SamplerOutput(ids[:, 0], lp[:, 0], ids if top else None, lp if top else None, ent if b.entropy else None)


def _sample_cut(logits: torch.Tensor, b: SamplingBatch, rows: list[int]) -> SamplerOutput | None:
    """sample() for cut_rows: the temperature as process_logits divides by it, top-k and top-p among each row's k
    largest logits (top_k_top_p_kept), and the race among the tokens they keep, in id order as _race has them:
    the tokens, noise draws and log-probs of _sample_full, without its passes over the vocabulary (~1.5 ms a row
    on the 2-core target, ~0.3 here). None when a row ties across its k-th largest logit: the full path then."""
    x = logits[rows]
    scaled = x / b.temperature[rows].to(x.device)[:, None]
    ids, _, kept, tied = top_k_top_p_kept(scaled, b.top_k[rows], b.top_p[rows])
    if bool(tied.any()):
        return None
    tokens = []
    for i, r in enumerate(rows):
        finite = kept[i].isfinite()
        candidates, values = ids[i][finite], kept[i][finite]
        order = candidates.argsort()
        tokens.append(int(candidates[order][_race_among(values[order], b.generators[r])]))
    return _from_stats(x, torch.tensor(tokens, dtype=torch.int64), cpu_logits.logit_stats(x, b.num_logprobs), b)


def _from_stats(logits: torch.Tensor, tokens: torch.Tensor, stats: tuple, b: SamplingBatch,
                stages: list | None = None) -> SamplerOutput:
    """The output of rows whose raw logits' statistics (cpu_logits.logit_stats: lse, entropy, top-N) were taken:
    each token's log-prob is its raw logit less the row's log-sum-exp."""
    lse, ent, top_ids, top_lp = stats
    top = b.num_logprobs > 0
    return SamplerOutput(tokens, logits.gather(1, tokens[:, None]).squeeze(1) - lse, top_ids if top else None,
                         top_lp if top else None, ent if b.entropy else None, stages=stages)


def _merge(n: int, parts: list[tuple[list[int], SamplerOutput]]) -> SamplerOutput:
    """Outputs of parts of one batch (take() keeps their shapes alike) as the batch's, row by row."""
    def put(name: str) -> torch.Tensor | None:
        xs = [getattr(out, name) for _, out in parts]
        if xs[0] is None:
            assert all(x is None for x in xs)
            return None
        whole = xs[0].new_empty((n, *xs[0].shape[1:]))
        for (rows, _), x in zip(parts, xs):
            whole[rows] = x.to(whole.dtype)
        return whole

    stages = None
    if any(out.stages is not None for _, out in parts):
        stages = [None] * n
        for rows, out in parts:
            for r, st in zip(rows, out.stages or []):
                stages[r] = st
    assert all(out.masked is None for _, out in parts)  # (no split with a grammar)
    return SamplerOutput(put("token_ids"), put("logprobs"), put("top_ids"), put("top_logprobs"), put("entropy"),
                         None, stages)


def _race(row: torch.Tensor, generator: torch.Generator | None, cut: bool) -> torch.Tensor:
    """One token drawn from softmax(row) by the exponential race, argmax(p / E) with E ~ Exp(1) from `generator`
    (None: the global one). On a CPU, a row that top-k, top-p or min-p cut (`cut`) races among its finite logits
    only: the same distribution (a -inf logit never wins) for noise over ~50 tokens instead of 49k (~0.7 ms a row
    on the 2-core target). On a GPU the noise is cheap and nonzero() would wait for the device: the whole row."""
    candidates = finite_ids(row) if cut and row.device.type == "cpu" else None
    won = _race_among(row if candidates is None else row[candidates], generator)
    return won if candidates is None else candidates[won]


def _race_among(values: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """The index that wins the exponential race over softmax(values) [n], with Exp(1) noise [n] from `generator`."""
    probs = values.softmax(dim=0)
    device = probs.device if generator is None else generator.device  # a seed gives the same noise on any device
    noise = exponential(probs.shape, generator, device).to(probs.dtype).to(probs.device)
    return (probs / noise).argmax()


def entropy(logprobs: torch.Tensor) -> torch.Tensor:
    """-(p * log p) summed over the last dim, in nats, from log-probabilities (-inf entries count 0)."""
    rows = logprobs.view(1, -1) if logprobs.dim() == 1 and logprobs.is_contiguous() else logprobs
    if cpu_logits.applies(rows):  # two passes in C instead of four ops over the vocabulary
        ent = cpu_logits.logit_stats(rows, 0)[1]
        return ent[0] if logprobs.dim() == 1 else ent
    p = logprobs.exp()
    return -(p * logprobs.masked_fill(p == 0, 0.0)).sum(dim=-1)


def position_noise(seed: int, position: int, size: int) -> torch.Tensor:
    """Exp(1) noise [size] that depends on (seed, position) alone: argmax(p / noise) then draws the token
    at `position` the same way however the steps around it were cut (speculative decoding, spec_decode)."""
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return exponential((size,), gen).float()


def exponential(shape: tuple[int, ...], generator: torch.Generator | None = None,
                device: torch.device | str | None = None) -> torch.Tensor:
    """Exp(1) noise (float64) as -log(U), U uniform on [0, 1) with 53 random bits: exactly the exponential
    distribution (U = 0 gives +inf noise, a token that cannot win the race), at ~1/3 of the cost of
    Tensor.exponential_, whose per-element CPU path took ~1 ms per 49k-token row on this 2-core CPU."""
    return torch.rand(shape, generator=generator, dtype=torch.float64, device=device).log_().neg_()

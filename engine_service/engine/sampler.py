"""Vectorised sampling over the batch, processors in Hugging Face's order:
logit_bias -> repetition penalty -> presence / frequency penalties -> (min_tokens EOS mask) -> temperature
-> top-k -> top-p -> min-p. (vLLM adds logit_bias before its penalties too; OpenAI's presence and frequency
penalties count the generated tokens only, HF's repetition penalty the prompt as well.)

Seeded rows draw their noise from their own generator, so a seeded request gives the same tokens
whatever else is in the batch (the exponential-race trick: argmax(p / E), E ~ Exp(1), samples p).
"""
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from engine_service.engine.sampling_params import SAMPLING_EPS, SamplingParams


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
        return cls(
            temperature=torch.tensor([0.0 if p.greedy else p.temperature for p in ps]),
            top_k=torch.tensor([p.top_k for p in ps]),
            top_p=torch.tensor([p.top_p for p in ps]),
            min_p=torch.tensor([p.min_p for p in ps]),
            repetition_penalty=torch.tensor([p.repetition_penalty for p in ps]),
            seen_tokens=seen,
            banned_tokens=[sorted(stop_ids(p)) if s.num_output_tokens < p.min_tokens else []
                           for s, p in zip(seqs, ps)],
            generators=[s.generator for s in seqs],
            num_logprobs=max(p.logprobs or 0 for p in ps),
            output_tokens=outputs, presence_penalty=presence, frequency_penalty=frequency,
            logit_bias=[p.logit_bias or {} for p in ps] if any(p.logit_bias for p in ps) else None,
        )

    def to(self, device: torch.device) -> "SamplingBatch":
        """The per-row tensors on the logits' device (the engine builds them on the CPU)."""
        if self.temperature.device == device:
            return self
        optional = ("seen_tokens", "output_tokens", "presence_penalty", "frequency_penalty")
        return replace(self, **{name: getattr(self, name).to(device) for name in (
            "temperature", "top_k", "top_p", "min_p", "repetition_penalty")},
            **{name: None if getattr(self, name) is None else getattr(self, name).to(device) for name in optional})


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    logprobs: torch.Tensor  # [S] raw logprob of the chosen token
    top_ids: torch.Tensor | None  # [S, N]
    top_logprobs: torch.Tensor | None  # [S, N]

    def rows(self, num_logprobs: list[int | None]) -> list[tuple[int, float, dict[int, float] | None]]:
        """Per row: (token, its log-prob, its top num_logprobs[row] {id: log-prob}, None when 0 or None)."""
        out = []
        for i, (token, logprob, k) in enumerate(zip(self.token_ids.tolist(), self.logprobs.tolist(), num_logprobs)):
            top = None
            if self.top_ids is not None and k:
                top = dict(zip(self.top_ids[i, :k].tolist(), self.top_logprobs[i, :k].tolist()))
            out.append((token, logprob, top))
        return out


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    # a mask, not gather/scatter: padding (-1) scattered onto a real id could overwrite its penalty
    vocab = logits.shape[1]
    mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, torch.where(seen >= 0, seen, vocab), True)
    p = penalty[:, None]
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(mask[:, :vocab], penalised, logits)


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


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    # top_k may stay on the CPU: its max sizes the topk without a device sync
    k = torch.where(top_k > 0, top_k, logits.shape[1]).clamp_max(logits.shape[1])
    kth = logits.topk(int(k.max()), dim=1).values.gather(1, (k - 1)[:, None].to(logits.device))
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # HF: sort ascending, drop the tokens whose cumulative probability stays <= 1 - top_p, keep >= 1
    sorted_logits, order = logits.sort(dim=1)
    cum = sorted_logits.softmax(dim=1).cumsum(dim=1)
    drop = cum <= (1 - top_p)[:, None]
    drop[:, -1] = False
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=1)
    threshold = min_p[:, None] * probs.max(dim=1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def process_logits(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Everything HF's processors do before the final softmax (greedy rows keep temperature 1)."""
    top_k = b.top_k  # flags and sizes from the batch as built (on the CPU): no device syncs
    use_top_k, use_top_p, use_min_p = bool((top_k > 0).any()), bool((b.top_p < 1).any()), bool((b.min_p > 0).any())
    b = b.to(logits.device)
    if b.logit_bias is not None:
        logits = apply_logit_bias(logits, b.logit_bias)
    if b.seen_tokens is not None:
        logits = apply_repetition_penalty(logits, b.seen_tokens, b.repetition_penalty)
    if b.output_tokens is not None:
        logits = apply_presence_frequency(logits, b.output_tokens, b.presence_penalty, b.frequency_penalty)
    for row, banned in enumerate(b.banned_tokens):
        if banned:
            logits[row, banned] = float("-inf")
    temp = torch.where(b.temperature >= SAMPLING_EPS, b.temperature, 1.0)
    logits = logits / temp[:, None]
    if use_top_k:
        logits = apply_top_k(logits, top_k)
    if use_top_p:
        logits = apply_top_p(logits, b.top_p)
    if use_min_p:
        logits = apply_min_p(logits, b.min_p)
    return logits


def sample(logits: torch.Tensor, b: SamplingBatch) -> SamplerOutput:
    raw_logprobs = logits.log_softmax(dim=1)
    processed = process_logits(logits.clone() if any(b.banned_tokens) else logits, b)
    all_greedy = bool((b.temperature < SAMPLING_EPS).all())
    greedy = b.temperature.to(logits.device) < SAMPLING_EPS
    tokens = processed.argmax(dim=1)
    if not all_greedy:
        probs = processed.softmax(dim=1)
        noise = torch.empty_like(probs).exponential_()
        for row, gen in enumerate(b.generators):
            if gen is not None:  # drawn where the generator lives: a seed gives the same noise on any device
                noise[row] = torch.empty(probs.shape[1], dtype=probs.dtype, device=gen.device).exponential_(
                    generator=gen)
        sampled = (probs / noise).argmax(dim=1)
        tokens = torch.where(greedy, tokens, sampled)
    chosen = raw_logprobs.gather(1, tokens[:, None]).squeeze(1)
    top_ids = top_lp = None
    if b.num_logprobs > 0:
        top_lp, top_ids = raw_logprobs.topk(b.num_logprobs, dim=1)
    return SamplerOutput(tokens, chosen, top_ids, top_lp)


def position_noise(seed: int, position: int, size: int) -> torch.Tensor:
    """Exp(1) noise [size] that depends on (seed, position) alone: argmax(p / noise) then draws the token
    at `position` the same way however the steps around it were cut (speculative decoding, spec_decode)."""
    key = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
    return torch.empty(size).exponential_(generator=gen)

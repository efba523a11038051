"""Vectorised sampling over the batch, processors in Hugging Face's order:
repetition penalty -> (min_tokens EOS mask) -> temperature -> top-k -> top-p -> min-p.

Seeded rows draw their noise from their own generator, so a seeded request gives the same tokens
whatever else is in the batch (the exponential-race trick: argmax(p / E), E ~ Exp(1), samples p).
"""
from dataclasses import dataclass, replace

import torch


@dataclass
class SamplingBatch:
    temperature: torch.Tensor  # [S] (0 = greedy)
    top_k: torch.Tensor  # [S] int (<= 0 disabled)
    top_p: torch.Tensor  # [S]
    min_p: torch.Tensor  # [S]
    repetition_penalty: torch.Tensor  # [S]
    seen_tokens: torch.Tensor | None  # [S, T] int64 prompt + output ids padded with -1 (penalty rows only)
    banned_tokens: list[list[int]]  # per row: ids masked this step (EOS before min_tokens)
    generators: list[torch.Generator | None]
    num_logprobs: int  # max top-N logprobs asked by any row

    def to(self, device: torch.device) -> "SamplingBatch":
        """The per-row tensors on the logits' device (the engine builds them on the CPU)."""
        if self.temperature.device == device:
            return self
        return replace(self, **{name: getattr(self, name).to(device) for name in (
            "temperature", "top_k", "top_p", "min_p", "repetition_penalty")},
            seen_tokens=None if self.seen_tokens is None else self.seen_tokens.to(device))


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    logprobs: torch.Tensor  # [S] raw logprob of the chosen token
    top_ids: torch.Tensor | None  # [S, N]
    top_logprobs: torch.Tensor | None  # [S, N]


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    # a mask, not gather/scatter: padding (-1) scattered onto a real id could overwrite its penalty
    vocab = logits.shape[1]
    mask = torch.zeros(logits.shape[0], vocab + 1, dtype=torch.bool, device=logits.device)
    mask.scatter_(1, torch.where(seen >= 0, seen, vocab), True)
    p = penalty[:, None]
    penalised = torch.where(logits < 0, logits * p, logits / p)
    return torch.where(mask[:, :vocab], penalised, logits)


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
    if b.seen_tokens is not None:
        logits = apply_repetition_penalty(logits, b.seen_tokens, b.repetition_penalty)
    for row, banned in enumerate(b.banned_tokens):
        if banned:
            logits[row, banned] = float("-inf")
    temp = torch.where(b.temperature > 0, b.temperature, 1.0)
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
    all_greedy = bool((b.temperature == 0).all())
    greedy = b.temperature.to(logits.device) == 0
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

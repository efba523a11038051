"""Speculative decoding at batch 1, predicted from step costs and an acceptance rate.

One iteration: k draft steps, one target forward over the k drafts (+1 position), then the accepted
drafts plus one target token (resampled, or the bonus after k acceptances) are kept. With the engine's
acceptance rate r = accepted / proposed at that k, an iteration yields 1 + k * r tokens on average.
To move to another k, r is turned into a per-token acceptance probability a under the usual i.i.d.
model (Leviathan et al. 2023): tokens per iteration = (1 - a^(k+1)) / (1 - a).
"""


def tokens_per_iteration(rate: float, k: int) -> float:
    """Mean tokens kept per iteration, from the measured accepted / proposed at this k."""
    assert 0 <= rate <= 1 and k >= 1
    return 1 + k * rate


def iid_tokens_per_iteration(alpha: float, k: int) -> float:
    return k + 1.0 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)


def per_token_acceptance(rate: float, k: int) -> float:
    """The i.i.d. acceptance probability a whose accepted / proposed at k equals rate (bisection;
    accepted / proposed = (a - a^(k+1)) / (k (1 - a)) grows with a)."""
    assert 0 <= rate <= 1 and k >= 1
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if (iid_tokens_per_iteration(mid, k) - 1) / k < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def speedup(tokens: float, k: int, target_ms: float, draft_ms: float, verify_ms: float,
            overhead_ms: float = 0.0) -> float:
    """Tokens per ms with speculation over tokens per ms without. overhead_ms is host time per forward
    (scheduling, sampling) that both pay: once per token without, k + 1 times per iteration with."""
    plain = target_ms + overhead_ms
    iteration = k * draft_ms + verify_ms + (k + 1) * overhead_ms
    return tokens * plain / iteration

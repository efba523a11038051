"""Prompt log-probs (SamplingParams.prompt_logprobs, vLLM's shape), scored during prefill.

The logits at prompt position p give the log-prob of prompt token p + 1, so a request scores positions
0 .. P - 2 as its prefill computes them: the model runner returns the logits of every chunk position not yet
scored (chunked prefill spreads them over steps; a preempted request recomputes and skips what it has). Such a
request never takes prefix-cache hits on its own prompt (scheduler.py), as in vLLM: a cached block would hide
its positions from the model.
"""
import torch

from engine_service.engine.sequence import Sequence


def positions_to_score(seq: Sequence, num_new_tokens: int) -> int:
    """How many of this step's chunk positions score prompt tokens: the trailing positions from the first one not
    scored yet up to P - 2 (0 when the request asks none or has them all)."""
    scored = seq.request.prompt_logprobs
    if scored is None:
        return 0
    first = max(seq.num_computed_tokens, len(scored) - 1)
    last = min(seq.num_computed_tokens + num_new_tokens, seq.num_prompt_tokens - 1)  # exclusive
    return max(0, last - first)


def score_prompt(seq: Sequence, logits: torch.Tensor) -> None:
    """Append the entries of the next len(logits) prompt positions: {id: log-prob} of the top N and the token."""
    req = seq.request
    start = len(req.prompt_logprobs)  # the prompt token the first row scores
    logprobs = logits.float().log_softmax(dim=-1)
    targets = torch.tensor(req.prompt_token_ids[start:start + len(logits)], device=logits.device)
    chosen = logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
    n = req.params.prompt_logprobs
    tops = [{}] * len(logits)
    if n:
        values, ids = logprobs.topk(n, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    for token, logprob, top in zip(targets.tolist(), chosen, tops):
        req.prompt_logprobs.append({**top, token: logprob})

"""The checks a request passes before it enters the engine (LLMEngine.add_request): ValueErrors in the form
`field: why`, for what a user can get wrong: an empty or out-of-vocabulary prompt, ids beyond the vocabulary,
more tokens than the context or the KV pool holds, beams that may not fit, a proposer the engine lacks."""
from __future__ import annotations

from dataclasses import dataclass

from engine_service.engine.sampling_params import SamplingParams
from engine_service.engine.utils import cdiv


@dataclass(frozen=True)
class EngineLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int
    max_beam_width: int
    has_drafter: bool


def check_request(prompt: str | list[int], params: SamplingParams, tokenizer,
                  lim: EngineLimits) -> tuple[str | None, list[int]]:
    """(prompt text or None, prompt token ids), or ValueError."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt: must not be empty")
        text, token_ids = prompt, tokenizer(prompt).input_ids
    else:
        text, token_ids = None, list(prompt)
        if not all(isinstance(t, int) and 0 <= t < lim.vocab_size for t in token_ids):
            raise ValueError(f"prompt_token_ids: every id must be an int in [0, {lim.vocab_size})")
    if not token_ids:
        raise ValueError("prompt: must not be empty")
    if any(t >= lim.vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids: every id must be below the vocabulary size {lim.vocab_size}")
    if any(t >= lim.vocab_size for t in params.logit_bias or {}):
        raise ValueError(f"logit_bias: every token id must be below the vocabulary size {lim.vocab_size}")
    if params.mode == "speculative" and params.proposer == "draft" and not lim.has_drafter:
        raise ValueError("proposer: 'draft' needs an engine started with a draft model "
                         "(LLM(..., draft_model=NAME) or --draft-model NAME)")
    if params.mode == "beam" and params.beam_width > lim.max_beam_width:
        raise ValueError(f"beam_width: {params.beam_width} is above this engine's max_beam_width "
                         f"({lim.max_beam_width})")
    total = len(token_ids) + params.max_tokens
    if total > lim.max_model_len:
        raise ValueError(f"max_tokens: prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) "
                         f"exceeds the model's context of {lim.max_model_len} tokens")
    if cdiv(total, lim.block_size) > lim.num_blocks:
        raise ValueError(f"max_tokens: {total} tokens need more KV blocks than the pool has "
                         f"({lim.num_blocks} x {lim.block_size})")
    if params.mode == "beam":
        # worst case: the full prompt blocks shared, every beam's tail its own
        shared = len(token_ids) // lim.block_size
        need = shared + params.beam_width * (cdiv(total, lim.block_size) - shared)
        if need > lim.num_blocks:
            raise ValueError(f"beam_width: {params.beam_width} beams of {total} tokens may need {need} KV "
                             f"blocks; the pool has {lim.num_blocks}")
    return text, token_ids

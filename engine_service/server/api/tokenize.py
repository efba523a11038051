"""vLLM's /tokenize and /detokenize: the model's tokenizer, without generating. A replica's app uses its engine's;
an API front the one the replicas publish to Redis (shared/router.py), so the ids are those the engine would run:
`count` is the `prompt_tokens` a request with the same prompt or messages reports."""
from __future__ import annotations

import anyio

from engine_service.server.api.state import APIError, ServiceState, not_ready
from shared.openai_schema import DetokenizeBody, TokenizeBody
from shared.routing import chat_prompt, prompt_token_ids


async def tokenize(state: ServiceState, body: TokenizeBody, max_model_len: int | None) -> dict:
    tok = await _tokenizer(state, body.model)
    request = body.to_request()

    def ids() -> list[int]:  # a long text or template takes a while: off the event loop
        if body.add_special_tokens is None and body.add_generation_prompt:
            return prompt_token_ids(request, tok)  # as the engine builds them
        text = body.prompt if request.messages is None else chat_prompt(request, tok, body.add_generation_prompt)
        special = body.add_special_tokens
        return tok(text, **({} if special is None else {"add_special_tokens": special})).input_ids

    try:
        tokens = await anyio.to_thread.run_sync(ids)
    except ValueError as e:  # the chat template refused the messages
        raise APIError(400, str(e)) from None
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens,
            "token_strs": tok.convert_ids_to_tokens(tokens) if body.return_token_strs else None}


async def detokenize(state: ServiceState, body: DetokenizeBody) -> dict:
    tok = await _tokenizer(state, body.model)
    if any(t >= len(tok) for t in body.tokens):
        raise APIError(400, f"tokens: every id must be below the tokenizer's vocabulary size {len(tok)}")
    return {"prompt": await anyio.to_thread.run_sync(tok.decode, body.tokens)}


async def _tokenizer(state: ServiceState, model: str | None):
    if model is not None and model != state.model_name:
        raise APIError(404, f"model {model!r} does not exist; this service serves {state.model_name!r}",
                       code="model_not_found")
    if not state.front:
        if state.replica is None:
            raise not_ready(state.model_name, "the model is loading")
        return state.replica.state.engine.tokenizer
    tok = await state.tokenizers().loaded_tokenizer(state.model_name)
    if tok is None:
        raise not_ready(state.model_name, "no replica has published its tokenizer")
    return tok

"""The OpenAI routes' work: check a body, submit it through Redis, answer whole or as server-sent events."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import aclosing

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from redis.exceptions import RedisError

from engine_service.engine.sampling_params import SamplingParams
from engine_service.server.api.state import APIError, ServiceState
from shared.client import QueueFull, TextAccumulator
from shared.openai_schema import (
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
)
from shared.protocol import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent

# A request over a limit is a 400, as OpenAI and vLLM answer (413 is kept for HTTP bodies over the byte limit,
# refused before they are read: api/body_limit.py).
STATUS_BY_CODE = {"invalid_request": 400, "unsupported_version": 400, "limit_exceeded": 400, "queue_full": 429,
                  "deadline_exceeded": 504, "timeout": 504, "unavailable": 503, "lost": 503, "engine_error": 500}


FAILOVER_DIVERGED = ("the replica running this request failed and its re-run produced different text from what "
                     "was already streamed; the stream ends here rather than mix two runs")
RETRY_AFTER_S = 1  # a full queue drains at the engine's pace; clients back off from here (the openai client does)


def client_id(http: Request) -> str:
    """Per-client limits count OpenAI requests by peer address (the `user` field is the caller's to choose)."""
    return f"openai:{http.client.host if http.client else 'unknown'}"


def check(state: ServiceState, body, request: GenerationRequest) -> None:
    if body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this service serves {state.model_name!r}",
                       code="model_not_found")
    if (why := state.limits.check(request)):
        raise APIError(400, why, code="limit_exceeded")
    try:  # the engine's own rules (mode/n/beam combinations, ...) before anything is queued
        SamplingParams(**request.params.model_dump())
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def serve(state: ServiceState, http: Request, body, request: GenerationRequest, chat: bool,
                 want_logprobs: bool):
    check(state, body, request)
    client = state.client
    try:
        sub = await client.submit(request)
    except QueueFull as e:  # or ClientBusy: this client has too many requests queued or running
        raise APIError(429, str(e), "rate_limit_error", e.code, headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    except (RedisError, OSError) as e:
        raise APIError(503, f"Redis unavailable: {e}", "service_unavailable") from None
    rid, model = request.request_id, body.model
    if not body.stream:
        result = await _result_unless_disconnected(state, http, sub)
        if result is None:  # the HTTP client went away: stop the generation
            return Response(status_code=499)
        _raise_on_error(result)
        return (chat_response if chat else completion_response)(rid, model, result, want_logprobs)
    # Beams are rewritten as they overtake each other, which an append-only SSE stream cannot show: a beam
    # request streams its outputs once they are final.
    stream_tokens = request.params.mode != "beam"
    return StreamingResponse(_sse(state, sub, rid, model, chat, want_logprobs, stream_tokens),
                             media_type="text/event-stream")


async def _result_unless_disconnected(state: ServiceState, http: Request, sub) -> DoneEvent | ErrorEvent | None:
    async def terminal():
        async with aclosing(state.client.stream(sub, state.request_timeout)) as events:
            async for ev in events:
                if isinstance(ev, (DoneEvent, ErrorEvent)):
                    return ev

    async def disconnected() -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(0.25)

    result, gone = asyncio.create_task(terminal()), asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
            with anyio.CancelScope(shield=True):
                await state.client.cancel(sub.request_id)
    return result.result() if result in done else None


def _raise_on_error(ev) -> None:
    if isinstance(ev, ErrorEvent):
        status = STATUS_BY_CODE.get(ev.code, 500)
        raise APIError(status, ev.message, "invalid_request_error" if status < 500 else "server_error", ev.code)


async def _sse(state: ServiceState, sub, rid: str, model: str, chat: bool, want_logprobs: bool,
               stream_tokens: bool) -> AsyncIterator[str]:
    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    text = TextAccumulator()
    started: set[int] = set()
    finished = False

    def chunk(index: int, delta: str, finish: str | None = None, logprobs=None) -> str:
        if chat:
            d = {"content": delta} if delta or finish is None else {}
            if index not in started:
                started.add(index)
                d = {"role": "assistant", **d}
            lp = chat_logprobs(logprobs) if want_logprobs and logprobs else None
            return data(chat_chunk(rid, model, index, d, finish, lp))
        lp = completion_logprobs(logprobs) if want_logprobs and logprobs else None
        return data(completion_chunk(rid, model, index, delta, finish, lp))

    try:
        async with aclosing(state.client.stream(sub, state.request_timeout)) as events:
            async for ev in events:
                if isinstance(ev, TokenEvent):
                    if not stream_tokens:
                        continue
                    delta = text.feed(ev)
                    if text.diverged:
                        break  # cancelled in `finally`; the client is told below
                    if delta:
                        yield chunk(ev.index, delta, logprobs=None if ev.reset else ev.logprobs)
                elif isinstance(ev, DoneEvent):
                    finals = [(c, text.final(c.index, c.text)) for c in ev.outputs]
                    if text.diverged:
                        break
                    finished = True
                    for c, delta in finals:
                        yield chunk(c.index, delta, c.finish_reason, logprobs=None if stream_tokens else c.logprobs)
                else:
                    finished = True
                    yield data(error_body(ev.message, "server_error", ev.code))
        if text.diverged:  # an append-only stream cannot take back what it sent: say so instead of mixing runs
            yield data(error_body(FAILOVER_DIVERGED, "server_error", "failover_diverged"))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # closed HTTP stream: cancel, shielded from the cancellation that got us here
            with anyio.CancelScope(shield=True):
                try:
                    await state.client.cancel(rid)
                except (RedisError, OSError):
                    pass

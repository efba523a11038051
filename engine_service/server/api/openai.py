"""The OpenAI routes' work: check a body, submit its requests through Redis (one per prompt of a completion batch,
all at once), answer whole or as server-sent events.

A batch's choices are numbered prompt_index * n + j, as OpenAI numbers them. A stream starts once each prompt's
first event came (or FIRST_EVENT_WAIT_S passed: a replica's refusal is a 400 as without `stream`), then sends
`: keep-alive` comments while no event comes (a request waiting in the queue, a long prefill), so that proxies and
clients keep the connection; with stream_options.include_usage its last chunk has no choices and the usage.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from redis.exceptions import RedisError

from engine_service.engine.sampling_params import SamplingParams
from engine_service.engine.structured import build_grammar
from engine_service.server.api.admission import RETRY_AFTER_S
from engine_service.server.api.state import APIError, ServiceState
from shared.client import QueueFull, Submission, TextAccumulator
from shared.openai_schema import (
    ChatBody,
    CompletionBody,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    error_body,
    usage,
    usage_chunk,
    vllm_prompt_logprobs,
)
from shared.openai_tools import ToolCalls, ToolCallStream
from shared.protocol import DoneEvent, ErrorEvent, GenerationRequest, PromptScores, TokenEvent, new_request_id

log = logging.getLogger("decodelab.api")

# A request over a limit is a 400, as OpenAI and vLLM answer (413 is kept for HTTP bodies over the byte limit,
# refused before they are read: api/body_limit.py).
STATUS_BY_CODE = {"invalid_request": 400, "unsupported_version": 400, "limit_exceeded": 400, "queue_full": 429,
                  "deadline_exceeded": 504, "timeout": 504, "unavailable": 503, "lost": 503, "engine_error": 500}


FIRST_EVENT_WAIT_S = 2.0  # a stream's response waits this long for each prompt's first event (serve)

FAILOVER_DIVERGED = ("the replica running this request failed and its re-run produced different text from what "
                     "was already streamed; the stream ends here rather than mix two runs")


@dataclass
class Reply:
    """How one body's protocol events become its OpenAI response."""

    id: str
    model: str
    chat: bool
    n: int  # choices per prompt
    want_logprobs: bool
    echo: list[str | None] | None = None  # echo=true: per prompt its text (None: a token-id prompt, the replica's)
    generated: bool = True  # False: echo with max_tokens=0, the one token the engine drew is not shown
    include_usage: bool = False
    vllm_prompt_logprobs: bool = False  # the body asked vLLM's prompt_logprobs: reported as vLLM does
    tools: ToolCalls | None = None  # chat with tool_choice a function or "required": the output is tool calls

    def echo_text(self, prompt_index: int, scores: PromptScores | None) -> str | None:
        if self.echo is None:
            return None
        text = self.echo[prompt_index]
        return text if text is not None else (scores.text if scores is not None else "")


def client_id(http: Request) -> str:
    """Per-client limits count OpenAI requests by peer address (the `user` field is the caller's to choose)."""
    return f"openai:{http.client.host if http.client else 'unknown'}"


async def completions(state: ServiceState, http: Request, body: CompletionBody):
    rid = f"cmpl-{new_request_id()}"
    requests = body.to_requests(rid, client_id(http))
    reply = Reply(rid, body.model, chat=False, n=body.n, want_logprobs=body.logprobs is not None,
                  echo=[p if isinstance(p, str) else None for p in body.prompts()] if body.echo else None,
                  generated=body.max_tokens > 0, include_usage=body.include_usage,
                  vllm_prompt_logprobs=body.prompt_logprobs is not None)
    return await serve(state, http, body, requests, reply)


async def chat_completions(state: ServiceState, http: Request, body: ChatBody):
    request = body.to_request(state.default_max_tokens, client_id(http))
    reply = Reply(request.request_id, body.model, chat=True, n=body.n, want_logprobs=body.logprobs,
                  include_usage=body.include_usage, vllm_prompt_logprobs=body.prompt_logprobs is not None,
                  tools=body.tool_calls())
    return await serve(state, http, body, [request], reply)


def check(state: ServiceState, body, requests: list[GenerationRequest], reply: Reply) -> None:
    if body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this service serves {state.model_name!r}",
                       code="model_not_found")
    most = state.limits.max_per_client
    if most and len(requests) > most:  # each prompt is a request of this client: more could never all run
        raise APIError(400, f"prompt: a batch of {len(requests)} prompts is above this service's limit of {most} "
                            f"requests per client (DECODELAB_MAX_PER_CLIENT)", code="limit_exceeded")
    for request in requests:
        if (why := state.limits.check(request)):
            raise APIError(400, why, code="limit_exceeded")
        try:  # the engine's own rules (mode/n/beam combinations, a grammar that does not parse) before queueing
            params = SamplingParams(**request.params.model_dump())
            if params.structured_outputs is not None:
                build_grammar(params.structured_outputs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
    if (unknown := body.unknown_fields()):  # accepted as OpenAI's servers and vLLM accept them, but said once
        log.warning("%s: ignoring fields this service does not know: %s", reply.id, ", ".join(sorted(unknown)))


async def serve(state: ServiceState, http: Request, body, requests: list[GenerationRequest], reply: Reply):
    check(state, body, requests, reply)
    subs = await _submit_all(state, requests, body.prompt_cache_key)
    if not body.stream:
        dones = await _results_unless_disconnected(state, http, subs)
        if dones is None:  # the HTTP client went away: stop the generation
            return Response(status_code=499)
        for done in dones:
            _raise_on_error(done)
        return _response(reply, dones)
    # Beams are rewritten as they overtake each other, which an append-only SSE stream cannot show: a beam
    # request streams its outputs once they are final.
    stream_tokens = requests[0].params.mode != "beam"
    events = _Events.start(state, subs)
    # The replica checks what only it knows (the prompt's tokens against its KV pool and limits) when it takes the
    # request: its refusal, usually within milliseconds, is a 400 before the stream starts, as without `stream`
    # and as vLLM answers; one later than the wait ends the stream with the error.
    try:
        await events.hold_firsts(len(subs), min(FIRST_EVENT_WAIT_S, state.sse_keepalive_s))
    except BaseException:  # cancelled meanwhile: no stream will read them
        events.stop()
        await _cancel_all(state, [sub.request_id for sub in subs])
        raise
    refused = next(((i, ev) for i, ev in events.held
                    if isinstance(ev, ErrorEvent) and STATUS_BY_CODE.get(ev.code, 500) < 500), None)
    if refused is not None:
        events.stop()
        await _cancel_all(state, [sub.request_id for j, sub in enumerate(subs) if j != refused[0]])
        _raise_on_error(refused[1])
    return StreamingResponse(_sse(state, subs, reply, stream_tokens, events), media_type="text/event-stream")


@dataclass
class _Events:
    """Every prompt's events through one queue, so that one loop interleaves them and sees the silences; a task
    per prompt pumps them in. `held`: events taken before the response started (hold_firsts), handed out first."""

    queue: asyncio.Queue
    pumps: list[asyncio.Task]
    held: list[tuple[int, TokenEvent | DoneEvent | ErrorEvent | Exception]] = field(default_factory=list)

    @classmethod
    def start(cls, state: ServiceState, subs: list[Submission]) -> _Events:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, sub: Submission) -> None:
            try:
                async with aclosing(state.client.stream(sub, state.request_timeout)) as stream:
                    async for ev in stream:
                        await queue.put((i, ev))
            except Exception as e:  # raised by the reader, as if it had read the stream itself
                await queue.put((i, e))

        return cls(queue, [asyncio.create_task(pump(i, sub)) for i, sub in enumerate(subs)])

    async def hold_firsts(self, prompts: int, timeout: float) -> None:
        """Take events until every prompt has sent one, one is an error, or `timeout` passed."""
        seen: set[int] = set()
        try:
            async with asyncio.timeout(timeout):
                while len(seen) < prompts:
                    i, ev = await self.queue.get()
                    self.held.append((i, ev))
                    seen.add(i)
                    if isinstance(ev, (ErrorEvent, Exception)):
                        return
        except TimeoutError:
            pass

    async def get(self) -> tuple[int, TokenEvent | DoneEvent | ErrorEvent | Exception]:
        return self.held.pop(0) if self.held else await self.queue.get()

    def stop(self) -> None:
        for task in self.pumps:
            task.cancel()


async def _submit_all(state: ServiceState, requests: list[GenerationRequest],
                      route_key: str | None = None) -> list[Submission]:
    """Submit every prompt's request at once; if one is refused, the others are cancelled."""
    results = await asyncio.gather(*(state.client.submit(r, route_key) for r in requests), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is None:
        for sub in results:
            state.route_metrics.observe(sub.route)
        return results
    for sub in results:
        if isinstance(sub, Submission):
            await sub.close()
            await state.client.cancel(sub.request_id)
    if isinstance(failed, QueueFull):  # or ClientBusy: this client has too many requests queued or running
        raise APIError(429, str(failed), "rate_limit_error", failed.code,
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    if isinstance(failed, (RedisError, OSError)):
        raise APIError(503, f"Redis unavailable: {failed}", "service_unavailable") from None
    raise failed


def _response(reply: Reply, dones: list[DoneEvent]) -> dict:
    if reply.chat:
        body = chat_response(reply.id, reply.model, dones[0], reply.want_logprobs, reply.tools)
        if reply.vllm_prompt_logprobs and dones[0].prompt is not None:
            body["prompt_logprobs"] = vllm_prompt_logprobs(dones[0].prompt)
        return body
    choices = []
    for i, done in enumerate(dones):
        echo = reply.echo_text(i, done.prompt)
        for c in done.outputs:
            choice = completion_choice(i * reply.n + c.index, c, reply.want_logprobs, echo, done.prompt,
                                       reply.generated)
            if reply.vllm_prompt_logprobs and done.prompt is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(done.prompt)
            choices.append(choice)
    return completion_response(reply.id, reply.model, choices, usage(dones, reply.generated))


async def _cancel_all(state: ServiceState, request_ids: list[str]) -> None:
    """Cancel requests, shielded from the cancellation that usually brings us here (a closed HTTP connection)."""
    with anyio.CancelScope(shield=True):
        for rid in request_ids:
            try:
                await state.client.cancel(rid)
            except (RedisError, OSError):
                pass


async def _results_unless_disconnected(state: ServiceState, http: Request,
                                       subs: list[Submission]) -> list[DoneEvent | ErrorEvent] | None:
    async def terminal(sub: Submission) -> DoneEvent | ErrorEvent:
        async with aclosing(state.client.stream(sub, state.request_timeout)) as events:
            async for ev in events:
                if isinstance(ev, (DoneEvent, ErrorEvent)):
                    return ev
        raise AssertionError("stream ended without a terminal event")

    async def every_terminal() -> list[DoneEvent | ErrorEvent]:
        return list(await asyncio.gather(*(terminal(sub) for sub in subs)))

    async def disconnected() -> None:
        while not await http.is_disconnected():
            await asyncio.sleep(0.25)

    result, gone = asyncio.create_task(every_terminal()), asyncio.create_task(disconnected())
    try:
        done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
            await _cancel_all(state, [sub.request_id for sub in subs])
    return result.result() if result in done else None


def _error_type(code: str) -> str:
    return "invalid_request_error" if STATUS_BY_CODE.get(code, 500) < 500 else "server_error"


def _raise_on_error(ev) -> None:
    if isinstance(ev, ErrorEvent):
        raise APIError(STATUS_BY_CODE.get(ev.code, 500), ev.message, _error_type(ev.code), ev.code)


async def _sse(state: ServiceState, subs: list[Submission], reply: Reply, stream_tokens: bool,
               events: _Events) -> AsyncIterator[str]:
    def data(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    started: set[int] = set()
    calls: dict[int, ToolCallStream] = {}  # per choice, with reply.tools

    def chunk(index: int, delta: str, finish: str | None = None, logprobs=None) -> str:
        if reply.chat:
            if reply.tools is None:
                d = {"content": delta} if delta or finish is None else {}
            else:  # the text is tool calls: sent as `tool_calls` entries, as they become whole enough to send
                entries = calls.setdefault(index, reply.tools.stream()).feed(delta)
                d = {"tool_calls": entries} if entries else {}
                finish = reply.tools.finish_reason(finish)
                if not d and finish is None and index in started and not (reply.want_logprobs and logprobs):
                    return ""  # nothing to say yet ("required": a call is sent once its element closed)
            if index not in started:
                started.add(index)
                d = {"role": "assistant", **d}
            lp = chat_logprobs(logprobs) if reply.want_logprobs and logprobs else None
            return data(chat_chunk(reply.id, reply.model, index, d, finish, lp))
        lp = completion_logprobs(logprobs) if reply.want_logprobs and logprobs else None
        return data(completion_chunk(reply.id, reply.model, index, delta, finish, lp))

    def echo(i: int, scores: PromptScores | None) -> list[str]:
        """The prompt's text (and log-probs) first, once per choice of prompt i (completions with echo)."""
        echoed.add(i)
        if reply.echo is None:
            return []
        text = reply.echo_text(i, scores)
        return [chunk(i * reply.n + j, text, logprobs=scores.logprobs if scores is not None else None)
                for j in range(reply.n)]

    texts = [TextAccumulator() for _ in subs]
    echoed: set[int] = set()
    dones: dict[int, DoneEvent] = {}
    failed: set[int] = set()
    try:
        while len(dones) < len(subs):
            try:  # (asyncio.timeout, not wait_for: no task created per event)
                async with asyncio.timeout(state.sse_keepalive_s):
                    i, ev = await events.get()
            except TimeoutError:
                yield ": keep-alive\n\n"
                continue
            if isinstance(ev, Exception):
                raise ev
            base, text = i * reply.n, texts[i]
            if isinstance(ev, ErrorEvent):
                failed.add(i)
                yield data(error_body(ev.message, _error_type(ev.code), ev.code))
                break
            if i not in echoed and (isinstance(ev, DoneEvent) or stream_tokens):
                for line in echo(i, ev.prompt):
                    yield line
            if isinstance(ev, TokenEvent):
                if not stream_tokens:
                    continue
                delta = text.feed(ev)
                if text.diverged:
                    break  # cancelled in `finally`; the client is told below
                if delta and reply.generated and (
                        line := chunk(base + ev.index, delta, logprobs=None if ev.reset else ev.logprobs)):
                    yield line
            else:
                finals = [(c, text.final(c.index, c.text)) for c in ev.outputs]
                if text.diverged:
                    break
                dones[i] = ev
                for c, delta in finals:
                    lp = None if stream_tokens or not reply.generated else c.logprobs
                    yield chunk(base + c.index, delta if reply.generated else "", c.finish_reason, logprobs=lp)
        if any(t.diverged for t in texts):  # an append-only stream cannot take back what it sent: say so
            yield data(error_body(FAILOVER_DIVERGED, "server_error", "failover_diverged"))
        elif reply.include_usage and not failed:
            yield data(usage_chunk(reply.id, reply.model, reply.chat, usage(list(dones.values()), reply.generated)))
        yield "data: [DONE]\n\n"
    finally:
        events.stop()
        # a closed HTTP stream, another prompt's error, a divergence: stop what still runs
        await _cancel_all(state, [sub.request_id for i, sub in enumerate(subs) if i not in dones and i not in failed])

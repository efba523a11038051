"""`decodelab engine`: one replica (engine + Redis worker) and its HTTP API (health, metrics, OpenAI)."""
from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError
from redis.exceptions import RedisError

from engine_service.server.body_limit import BodyLimit
from engine_service.engine.sampling_params import SamplingParams
from engine_service.server.worker import Worker, WorkerConfig, WorkerMetrics
from shared.client import EngineClient, QueueFull, TextAccumulator
from shared.keys import Keys
from shared.limits import Limits
from shared.openai_schema import (ChatBody, CompletionBody, chat_chunk, chat_logprobs, chat_response, completion_chunk,
                                  completion_logprobs, completion_response, error_body)
from shared.protocol import DoneEvent, ErrorEvent, GenerationRequest, TokenEvent, validation_message

log = logging.getLogger("decodelab.api")
disable_created_metrics()
STATUS_BY_CODE = {"invalid_request": 400, "unsupported_version": 400, "limit_exceeded": 413, "queue_full": 429,
                  "deadline_exceeded": 504, "timeout": 504, "unavailable": 503, "lost": 503, "engine_error": 500}


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type_, code


@dataclass
class ServiceState:
    model_name: str
    client: EngineClient
    registry: CollectorRegistry
    api_key: str | None = None
    default_max_tokens: int = 256
    request_timeout: float = 600.0
    drain_timeout: float = 30.0
    limits: Limits = field(default_factory=Limits.from_env)
    worker: Worker | None = None  # set once the model is loaded
    load_error: str | None = None
    started_at: float = field(default_factory=time.time)


class EngineCollector:
    """Engine and queue gauges, read from the worker's latest stats snapshot at scrape time."""

    def __init__(self, state: ServiceState):
        self.state = state

    def collect(self):
        worker = self.state.worker
        if worker is None:
            return
        st = worker.stats
        blocks = GaugeMetricFamily("decodelab_kv_blocks", "KV cache blocks by state", labels=["state"])
        for state in ("total", "used", "shared", "cached", "free"):
            blocks.add_metric([state], st.get(f"blocks_{state}", 0))
        yield blocks
        queries, hits = st.get("prefix_queries", 0), st.get("prefix_hits", 0)
        yield CounterMetricFamily("decodelab_prefix_cache_queries", "Prefix-cache block lookups", value=queries)
        yield CounterMetricFamily("decodelab_prefix_cache_hits", "Prefix-cache block hits", value=hits)
        yield GaugeMetricFamily("decodelab_prefix_cache_hit_rate", "hits / queries", value=hits / queries if queries else 0)
        yield CounterMetricFamily("decodelab_preemptions", "Sequences preempted", value=st.get("preemptions", 0))
        yield CounterMetricFamily("decodelab_cow_copies", "Copy-on-write block copies", value=st.get("cow_copies", 0))
        proposed, accepted = st.get("spec_proposed"), st.get("spec_accepted")
        if proposed is not None and accepted is not None:
            yield CounterMetricFamily("decodelab_spec_proposed_tokens", "Draft tokens proposed", value=proposed)
            yield CounterMetricFamily("decodelab_spec_accepted_tokens", "Draft tokens accepted", value=accepted)
            yield GaugeMetricFamily("decodelab_spec_acceptance_rate", "accepted / proposed",
                                    value=accepted / proposed if proposed else 0)
        yield GaugeMetricFamily("decodelab_num_running", "Sequences running in the batch", value=st.get("num_running", 0))
        yield GaugeMetricFamily("decodelab_num_waiting", "Requests waiting inside the engine", value=st.get("num_waiting", 0))
        yield GaugeMetricFamily("decodelab_replica_requests", "Requests held by this replica", value=len(worker.jobs))
        yield GaugeMetricFamily("decodelab_queue_length", "Requests waiting in the Redis stream for any replica",
                                value=worker.queue_length)


def create_app(state: ServiceState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Shutdown (after open HTTP streams ended): stop pulling, let running requests finish, stop.
        if (worker := state.worker) is not None:
            if not await anyio.to_thread.run_sync(worker.drain, state.drain_timeout):
                log.warning("shutdown: %d requests unfinished; other replicas will re-run them", len(worker.jobs))
            await anyio.to_thread.run_sync(worker.stop)
        await state.client.close()

    app = FastAPI(title="DecodeLab engine", version="1", lifespan=lifespan)
    app.state.service = state
    state.registry.register(EngineCollector(state))

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message = validation_message(list(e.errors()), skip_loc=1, what="body")
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)

    @app.exception_handler(ValidationError)  # a body the OpenAI schema took but the protocol refuses (e.g. 17 stops)
    async def _protocol_error(_: Request, e: ValidationError) -> JSONResponse:
        return JSONResponse(error_body(validation_message(e.errors()), "invalid_request_error"), status_code=400)

    # A dependency, not an HTTP middleware: BaseHTTPMiddleware hides client disconnects from the endpoints.
    async def check_api_key(request: Request) -> None:
        if state.api_key:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), state.api_key.encode()):
                raise APIError(401, "invalid API key", "authentication_error")

    app.add_middleware(BodyLimit, why_too_large=lambda n: state.limits.check_size(n))
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "uptime_s": round(time.time() - state.started_at, 1)}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        redis_ok = True
        try:
            await asyncio.wait_for(state.client.redis.ping(), 2.0)
        except (RedisError, OSError, asyncio.TimeoutError):
            redis_ok = False
        body = {"model_loaded": state.worker is not None, "redis": redis_ok, "model": state.model_name,
                "load_error": state.load_error}
        return JSONResponse(body, status_code=200 if state.worker is not None and redis_ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started_at),
                                            "owned_by": "decodelab"}]}

    @v1.post("/completions")
    async def completions(body: CompletionBody, http: Request):
        return await _serve(state, http, body, body.to_request(_client_id(http)), chat=False,
                            want_logprobs=body.logprobs is not None)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatBody, http: Request):
        request = body.to_request(state.default_max_tokens, _client_id(http))
        return await _serve(state, http, body, request, chat=True, want_logprobs=body.logprobs)

    app.include_router(v1)
    return app


def _client_id(http: Request) -> str:
    """Per-client limits count OpenAI requests by peer address (the `user` field is the caller's to choose)."""
    return f"openai:{http.client.host if http.client else 'unknown'}"


def _check(state: ServiceState, body, request: GenerationRequest) -> None:
    if body.model != state.model_name:
        raise APIError(404, f"model {body.model!r} does not exist; this service serves {state.model_name!r}",
                       code="model_not_found")
    if (why := state.limits.check(request)):
        raise APIError(413, why, code="limit_exceeded")
    try:  # the engine's own rules (mode/n/beam combinations, ...) before anything is queued
        SamplingParams(**request.params.model_dump())
    except ValueError as e:
        raise APIError(400, str(e)) from None


async def _serve(state: ServiceState, http: Request, body, request: GenerationRequest, chat: bool,
                 want_logprobs: bool):
    _check(state, body, request)
    client = state.client
    try:
        sub = await client.submit(request)
    except QueueFull as e:  # or ClientBusy: this client has too many requests queued or running
        raise APIError(429, str(e), "rate_limit_error", e.code) from None
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
                    if delta:
                        yield chunk(ev.index, delta, logprobs=None if ev.reset else ev.logprobs)
                elif isinstance(ev, DoneEvent):
                    finished = True
                    for c in ev.outputs:
                        yield chunk(c.index, text.final(c.index, c.text), c.finish_reason,
                                    logprobs=None if stream_tokens else c.logprobs)
                else:
                    finished = True
                    yield data(error_body(ev.message, "server_error", ev.code))
        yield "data: [DONE]\n\n"
    finally:
        if not finished:  # closed HTTP stream: cancel, shielded from the cancellation that got us here
            with anyio.CancelScope(shield=True):
                try:
                    await state.client.cancel(rid)
                except (RedisError, OSError):
                    pass


# ---- the `decodelab engine` command (engine options come from cli.add_engine_args)
def add_engine_parser(subparsers, add_engine_args) -> argparse.ArgumentParser:
    p = subparsers.add_parser("engine", help="run one engine replica: Redis worker + HTTP API (OpenAI, metrics)")
    add_engine_args(p)
    add_service_args(p)
    p.set_defaults(func=run_engine)
    return p


def add_service_args(p: argparse.ArgumentParser) -> None:
    env = os.environ.get
    p.add_argument("--served-model-name", default=None, help="model id in the OpenAI API (default: --model)")
    p.add_argument("--redis-url", default=env("REDIS_URL"), help="default: $REDIS_URL")
    p.add_argument("--host", default=env("DECODELAB_HOST", "127.0.0.1"))
    p.add_argument("--port", type=int, default=int(env("DECODELAB_ENGINE_PORT", 8000)))
    p.add_argument("--api-key", default=env("DECODELAB_API_KEY") or None, help="default: $DECODELAB_API_KEY")
    p.add_argument("--replica-name", default=None)
    p.add_argument("--claim-idle", type=float, default=float(env("DECODELAB_CLAIM_IDLE_S", 10.0)),
                   help="seconds before a dead replica's request is re-run elsewhere")
    p.add_argument("--max-queue", type=int, default=int(env("DECODELAB_MAX_QUEUE", 256)),
                   help="requests waiting in Redis beyond which new ones are refused")
    p.add_argument("--expected-tokens", type=int, default=int(env("DECODELAB_EXPECTED_TOKENS", 256)),
                   help="per-request KV estimate (prompt + output tokens) when deciding how many requests to pull; "
                        "lower admits more and relies on preemption when they outgrow the pool")
    p.add_argument("--default-max-tokens", type=int, default=256, help="chat completions without max_tokens")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="on shutdown, seconds to finish running requests")
    p.add_argument("--log-level", default=env("DECODELAB_LOG_LEVEL", "info"))


def _load(state: ServiceState, args, metrics: WorkerMetrics, server) -> None:
    from engine_service.cli import engine_config_from_args
    from engine_service.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(engine_config_from_args(args))
        cfg = WorkerConfig(args.redis_url, keys=state.client.keys, model_name=state.model_name,
                           claim_idle_s=args.claim_idle, expected_tokens=args.expected_tokens)
        if args.replica_name:
            cfg.name = args.replica_name
        state.worker = Worker(engine, cfg, metrics).start()
        log.info("replica %s ready: model %s", cfg.name, state.model_name)
    except Exception as e:
        log.exception("model load failed")
        state.load_error = f"{type(e).__name__}: {e}"
        server.should_exit = True


def run_engine(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not args.redis_url:
        raise SystemExit("decodelab engine: no Redis; pass --redis-url or set REDIS_URL (or use `decodelab play`)")
    registry = CollectorRegistry()
    client = EngineClient(args.redis_url, Keys.from_env(), max_queue=args.max_queue)
    state = ServiceState(model_name=args.served_model_name or args.model, client=client, registry=registry,
                         api_key=args.api_key, default_max_tokens=args.default_max_tokens,
                         drain_timeout=args.drain_timeout)
    app = create_app(state)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower()))
    loader = threading.Thread(target=_load, args=(state, args, WorkerMetrics(registry), server), daemon=True)
    loader.start()  # the API answers /health (and /ready = 503) while the model loads
    server.run()  # on SIGINT / SIGTERM the app's lifespan drains the worker
    return 0 if state.load_error is None else 1


def main(argv: list[str] | None = None) -> int:
    from engine_service.cli import add_engine_args

    parser = argparse.ArgumentParser(prog="decodelab engine")
    add_engine_args(parser)
    add_service_args(parser)
    return run_engine(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())

"""The FastAPI app of a replica (`decodelab engine`) or of an API front (`decodelab api`, no engine in its process):
/health, /ready, /metrics and the OpenAI routes under /v1. Either way requests go through Redis."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, disable_created_metrics, generate_latest
from pydantic import ValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine_service.server.api.admission import Admission
from engine_service.server.api.body_limit import BodyLimit
from engine_service.server.api.openai import chat_completions, completions
from engine_service.server.api.state import APIError, ServiceState, not_ready
from engine_service.server.api.tokenize import detokenize, tokenize
from engine_service.server.metrics import EngineCollector
from shared import monitor
from shared.openai_schema import ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, error_body
from shared.protocol import validation_message

log = logging.getLogger("decodelab.api")
disable_created_metrics()


def max_model_len(replicas: list[dict]) -> int | None:
    """Prompt + output tokens every serving replica takes (None: none said; older replicas do not)."""
    return min((n for info in replicas if (n := info.get("max_model_len", 0)) > 0), default=None)


def create_app(state: ServiceState, *, preload_tokenizer: bool = False) -> FastAPI:
    """`preload_tokenizer`: an API front loads the tokenizer the replicas publish at start, not at its first
    request (shared/router.py). A replica's own app does not: its process runs the engine and has imported
    transformers already, so the first request's load is short there, and it need not share a core with the start."""
    @asynccontextmanager
    async def lifespan(_: FastAPI):
        router = state.client.router
        preload = asyncio.create_task(router.preload()) if router is not None and preload_tokenizer else None
        yield
        if preload is not None:
            preload.cancel()
        # Shutdown (intake already stopped at the signal, see engine_cmd): let running requests finish within the
        # grace period, hand the rest back to the stream for another replica, stop.
        if (replica := state.replica) is not None:
            if not await anyio.to_thread.run_sync(replica.drain, state.drain_timeout):
                handed = await anyio.to_thread.run_sync(replica.hand_back)
                log.warning("shutdown: %d requests unfinished, handed back for other replicas", handed)
            await anyio.to_thread.run_sync(replica.stop)
        await state.client.close()

    app = FastAPI(title="DecodeLab engine", version="1", lifespan=lifespan)
    app.state.service = state
    state.registry.register(EngineCollector(lambda: state.replica.state if state.replica is not None else None))

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.type, e.code), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's own 404 / 405 ...: OpenAI-shaped too
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        type_ = {401: "authentication_error", 404: "not_found_error"}.get(e.status_code, "invalid_request_error")
        return JSONResponse(error_body(str(e.detail), type_, None), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message = validation_message(list(e.errors()), skip_loc=1, what="body")
        return JSONResponse(error_body(message, "invalid_request_error"), status_code=400)

    @app.exception_handler(ValidationError)  # a body the OpenAI schema took but the protocol refuses (e.g. 17 stops)
    async def _protocol_error(_: Request, e: ValidationError) -> JSONResponse:
        return JSONResponse(error_body(validation_message(e.errors()), "invalid_request_error"), status_code=400)

    @app.exception_handler(Exception)  # a bug: still an OpenAI-shaped 500 (Starlette logs the traceback)
    async def _internal_error(_: Request, e: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error", "internal_error"),
                            status_code=500)

    # A dependency, not an HTTP middleware: BaseHTTPMiddleware hides client disconnects from the endpoints.
    async def check_api_key(request: Request) -> None:
        if state.api_key:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), state.api_key.encode()):
                raise APIError(401, "invalid API key", "authentication_error")

    app.add_middleware(BodyLimit, why_too_large=lambda n: state.limits.check_size(n))
    app.add_middleware(Admission, limit=lambda: state.max_inflight)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "uptime_s": round(time.time() - state.started_at, 1)}

    async def serving() -> tuple[bool, list[dict]]:
        """Whether Redis answers, and the live replicas that serve the model and take requests (a replica's own
        app: itself, once its model has loaded)."""
        try:
            await asyncio.wait_for(state.client.redis.ping(), 2.0)
            if not state.front:
                return True, [] if state.replica is None else [
                    {"max_model_len": state.replica.state.engine.max_model_len}]
            live = await asyncio.wait_for(monitor.replicas(state.client.redis, state.client.keys), 2.0)
        except (TimeoutError, RedisError, OSError):
            return False, []
        return True, [info for info in live.values()
                      if info.get("model") == state.model_name and info.get("accepting", True)]

    @app.get("/ready")
    async def ready() -> JSONResponse:
        redis_ok, replicas = await serving()
        if state.front:  # an API front: ready while Redis answers and some replica serves the model
            body = {"redis": redis_ok, "model": state.model_name, "replicas": len(replicas)}
            return JSONResponse(body, status_code=200 if redis_ok and replicas else 503)
        body = {"model_loaded": state.replica is not None, "redis": redis_ok, "model": state.model_name,
                "load_error": state.load_error}
        return JSONResponse(body, status_code=200 if state.replica is not None and redis_ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @v1.get("/models")
    async def models() -> dict:
        # Listed once it can be served, as vLLM's server (which listens only after its model loads): clients and
        # scripts that poll /v1/models before their first request then do not wait out a model's load in it.
        redis_ok, replicas = await serving()
        if not (redis_ok and replicas):
            why = ("Redis does not answer" if not redis_ok else "no replica serves it yet" if state.front
                   else f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading")
            raise not_ready(state.model_name, why)
        card = {"id": state.model_name, "object": "model", "created": int(state.started_at), "owned_by": "decodelab",
                "root": state.model_name, "parent": None}
        if (length := max_model_len(replicas)) is not None:
            card["max_model_len"] = length
        return {"object": "list", "data": [card]}

    @v1.post("/completions")
    async def completion_route(body: CompletionBody, http: Request):
        return await completions(state, http, body)

    @v1.post("/chat/completions")
    async def chat_route(body: ChatBody, http: Request):
        return await chat_completions(state, http, body)

    # vLLM's tokenizer routes (at the root, as vLLM serves them)
    @app.post("/tokenize", dependencies=[Depends(check_api_key)])
    async def tokenize_route(body: TokenizeBody) -> dict:
        _, replicas = await serving()
        return await tokenize(state, body, max_model_len(replicas))

    @app.post("/detokenize", dependencies=[Depends(check_api_key)])
    async def detokenize_route(body: DetokenizeBody) -> dict:
        return await detokenize(state, body)

    app.include_router(v1)
    return app

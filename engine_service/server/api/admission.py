"""Bounds the generation requests one API process holds at once; beyond the bound it answers 429 with Retry-After.

A pure ASGI middleware: a request counts from its first byte until its response ends, a streamed one included,
so the bound is on open generations, not on how fast the app returns a StreamingResponse.
"""
import json
from collections.abc import Callable

from shared.openai_schema import error_body

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
RETRY_AFTER_S = 1  # seconds; every 429 of the API says it (a full queue drains at the engine's pace)


class Admission:
    def __init__(self, app, limit: Callable[[], int]):
        self.app = app
        self.limit = limit  # read per request, so the service state can change it
        self.inflight = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        if self.inflight >= self.limit():
            body = json.dumps(error_body(f"too many requests in flight on this API process ({self.inflight}, limit "
                                         f"{self.limit()}, DECODELAB_MAX_INFLIGHT); retry shortly",
                                         "rate_limit_error", "too_many_requests")).encode()
            headers = [(b"content-type", b"application/json"), (b"retry-after", str(RETRY_AFTER_S).encode()),
                       (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 429, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1

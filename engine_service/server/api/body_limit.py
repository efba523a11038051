"""Refuses HTTP bodies over the service's request-size limit before they are read into memory.

A pure ASGI middleware (BaseHTTPMiddleware would hide client disconnects from the streaming endpoints):
a declared Content-Length over the limit is answered 413 without reading a byte; a chunked body is
counted as it arrives and the app's answer to the cut-off body is replaced by the same 413.
"""
import json
from collections.abc import Callable

from shared.openai_schema import error_body


class BodyLimit:
    def __init__(self, app, why_too_large: Callable[[int], str | None]):
        self.app = app
        self.why_too_large = why_too_large  # bytes -> the refusal message, or None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and (why := self.why_too_large(int(length))):
            return await _refuse(send, why)
        received, refused = 0, None

        async def counting_receive():
            nonlocal received, refused
            message = await receive()
            if message["type"] == "http.request" and refused is None:
                received += len(message.get("body", b""))
                if (why := self.why_too_large(received)):
                    refused = why  # the app sees an empty, final body; its answer is swapped below
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        async def guarded_send(message) -> None:
            if refused is None:
                return await send(message)
            if message["type"] == "http.response.start":
                await _refuse(send, refused)

        await self.app(scope, counting_receive, guarded_send)


async def _refuse(send, why: str) -> None:
    body = json.dumps(error_body(why, "invalid_request_error", "limit_exceeded")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

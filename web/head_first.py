"""A script that must run before Gradio's own: put first in the page's <head> on the way out.

Gradio adds `launch(head=...)` from its config once its modules have loaded, too late for web/frames.js, which has
to wrap requestAnimationFrame before Gradio's status trackers capture it. This ASGI middleware rewrites the HTML
pages the app serves (GET, text/html; a HEAD's length says what GET's will be); everything else passes untouched.
"""
from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
App = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]


class HeadFirst:
    def __init__(self, app: App, script: str):
        self.app = app
        self.tag = f"<script>{script}</script>".encode()

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        head = scope["method"] == "HEAD"
        start: Message | None = None
        body = bytearray()

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers", []))
                html = headers.get(b"content-type", b"").startswith(b"text/html") and b"content-encoding" not in headers
                if html and head and b"content-length" in headers:  # the length GET's page will have
                    length = str(int(headers[b"content-length"]) + len(self.tag)).encode()
                    message = {**message, "headers": [(k, length if k == b"content-length" else v)
                                                      for k, v in message["headers"]]}
                elif html and not head:
                    start = message  # held until the whole page is here
                    return
                return await send(message)
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            body.extend(message.get("body", b""))
            if message.get("more_body"):
                return
            page = with_script(bytes(body), self.tag)
            headers = [(k, v) for k, v in start.get("headers", []) if k != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(page)).encode())]})
            await send({"type": "http.response.body", "body": page})

        await self.app(scope, receive, rewrite)


def with_script(page: bytes, tag: bytes) -> bytes:
    """The page with `tag` right after its <head> (or first, where it has none)."""
    at = page.find(b"<head>")
    return page[:at + 6] + tag + page[at + 6:] if at >= 0 else tag + page

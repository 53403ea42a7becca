"""Front-end limits that must act before a request costs anything: body size, active requests.

`BodyLimitMiddleware` is plain ASGI (no Starlette Request), so an oversized upload is refused
from its headers alone, or as soon as the streamed bytes pass the limit, without ever holding
more than `max_bytes` of it in memory.  It also counts the HTTP requests in progress, which the
SIGTERM drain waits for (an engine sequence finishing is not the same as its response having
been written).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

from server.errors import anthropic_error_body, error_body

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class RequestCounter:
    """HTTP requests whose response has not finished yet (drain waits for 0)."""

    def __init__(self) -> None:
        self.active = 0


async def _send_413(send: Send, limit: int, path: str = "") -> None:
    msg = f"The request body exceeds the server's limit of {limit} bytes (--max-body-bytes)."
    # /v1/messages clients (Anthropic SDKs) read Anthropic's error shape.
    obj = (
        anthropic_error_body(413, msg)
        if path.startswith("/v1/messages")
        else error_body(413, msg, None, "request_too_large")
    )
    body = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 413,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, counter: RequestCounter) -> None:
        self.app, self.max_bytes, self.counter = app, max_bytes, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.counter.active += 1
        try:
            await self._http(scope, receive, send)
        finally:
            self.counter.active -= 1

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if declared is not None:
            try:
                too_big = int(declared) > self.max_bytes
            except ValueError:
                too_big = False  # h11 rejects a malformed Content-Length before we get here
            if too_big:  # refuse from the header: the body is never read
                await _send_413(send, self.max_bytes, scope.get("path", ""))
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        # Chunked or lying uploads: read (bounded) here, then replay to the app.
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                chunks.clear()
                await _send_413(send, self.max_bytes, scope.get("path", ""))
                return
            chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        body = b"".join(chunks)
        chunks.clear()
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls: wait for the disconnect, as Starlette expects

        await self.app(scope, replay, send)

"""Request body size limit, enforced while reading (never buffering more than the limit).

A declared ``Content-Length`` above the limit is refused before any byte is read; otherwise
the bytes actually received are counted (chunked uploads have no length) and reading stops
with 413 as soon as the count passes the limit.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.errors import PayloadTooLargeError


class BodyTooLargeError(PayloadTooLargeError):
    """Raised from ``receive`` inside the app; FastAPI turns it into a JSON 413."""


async def _send_json(send: Send, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int,
                 path_limits: dict[str, int] | None = None) -> None:
        """``path_limits``: a larger (or smaller) limit for the paths under a prefix (data set
        uploads)."""
        self.app = app
        self.default = max_body_bytes
        self.path_limits = sorted((path_limits or {}).items(), key=lambda kv: -len(kv[0]))

    def _limit(self, path: str) -> int:
        for prefix, limit in self.path_limits:
            if path == prefix or path.startswith(prefix.rstrip("/") + "/"):
                return limit
        return self.default

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope.get("path", ""))

        def detail(declared: int | None = None) -> str:
            size = f" ({declared} bytes declared)" if declared is not None else ""
            return f"request body exceeds the limit of {limit} bytes{size}"

        declared = None
        for key, value in scope.get("headers", []):
            if key == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await _send_json(send, 400, "invalid Content-Length header")
                    return
        if declared is not None and declared > limit:
            await _send_json(send, 413, detail(declared))
            return

        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLargeError(detail())
            return message

        async def send_wrapper(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, send_wrapper)
        except BodyTooLargeError as e:  # escaped the app's own handlers
            if started:
                raise
            await _send_json(send, 413, str(e.detail))

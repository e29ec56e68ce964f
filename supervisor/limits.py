"""Refuse request bodies over the configured size with 413, before they are parsed.

A pure ASGI middleware (Starlette's BaseHTTPMiddleware costs a task per request): the
Content-Length is checked up front; a body without one is counted as it streams in.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]


class BodyTooLarge(HTTPException):
    """Raised while the body streams in; an HTTPException so that FastAPI's body reader passes
    it through as the 413 answer instead of wrapping it in a 400."""

    def __init__(self, detail: str) -> None:
        super().__init__(status_code=413, detail=detail)


class BodySizeLimit:
    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    await self._refuse(send, 400, "Content-Length is not a number")
                    return
                if declared > self.max_bytes:
                    await self._refuse(send, 413, self._msg(declared))
                    return
                break
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            msg: Message = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self._msg(seen))
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await self._refuse(send, 413, self._msg(seen))

    def _msg(self, n: int) -> str:
        return f"request body of {n} bytes is over the limit of {self.max_bytes} bytes"

    @staticmethod
    async def _refuse(send: Any, code: int, detail: str) -> None:
        body = json.dumps({"detail": detail}).encode()
        await send({"type": "http.response.start", "status": code,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

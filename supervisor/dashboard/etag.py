"""Conditional GETs: a body-hash ETag on the dashboard's pages and the run read API, and 304
when the client already holds that body.

A route may set its own (cheap) ETag and answer 304 itself before doing any work (the
dashboard's state route does); the middleware then leaves the response alone.
"""

from __future__ import annotations

import hashlib
from typing import Any

PREFIXES = ("/runs", "/api/v1/runs", "/api/v1/actions", "/dashboard/api/")


def applies(path: str) -> bool:
    return path == "/" or path.startswith(PREFIXES)


def matches(if_none_match: str | None, etag: str) -> bool:
    if not if_none_match:
        return False
    tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
    return "*" in tags or etag.removeprefix("W/") in tags


class ConditionalGet:
    """Pure ASGI middleware (buffers the bodies of the GET responses it applies to)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") != "GET" or not applies(scope["path"]):
            await self.app(scope, receive, send)
            return
        inm = None
        for k, v in scope.get("headers") or []:
            if k == b"if-none-match":
                inm = v.decode("latin-1")
        start: dict[str, Any] | None = None
        chunks: list[bytes] = []
        passthrough = False

        async def buffer(msg: dict[str, Any]) -> None:
            nonlocal start, passthrough
            if passthrough or msg["type"] not in ("http.response.start", "http.response.body"):
                await send(msg)
                return
            if msg["type"] == "http.response.start":
                names = {k.lower() for k, _ in msg.get("headers", [])}
                if msg["status"] != 200 or b"etag" in names:
                    passthrough = True
                    await send(msg)
                    return
                start = msg
                return
            chunks.append(msg.get("body", b""))
            if not msg.get("more_body"):
                assert start is not None
                await _finish(send, start, b"".join(chunks), inm)

        await self.app(scope, receive, buffer)


async def _finish(send: Any, start: dict[str, Any], body: bytes, inm: str | None) -> None:
    etag = 'W/"' + hashlib.sha256(body).hexdigest()[:32] + '"'
    headers = [(k, v) for k, v in start.get("headers", [])
               if k.lower() not in (b"content-length", b"cache-control")]
    headers += [(b"etag", etag.encode()), (b"cache-control", b"private, no-cache"),
                (b"vary", b"Authorization, Cookie")]
    if matches(inm, etag):
        keep = [(k, v) for k, v in headers if k.lower() != b"content-type"]
        await send({"type": "http.response.start", "status": 304, "headers": keep})
        await send({"type": "http.response.body", "body": b""})
        return
    headers.append((b"content-length", str(len(body)).encode()))
    await send({**start, "headers": headers})
    await send({"type": "http.response.body", "body": body})

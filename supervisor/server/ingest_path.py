"""``IngestPath``: ``POST /api/v1/ingest`` answered ahead of the middleware stack.

Every node agent posts a batch a second: at thousands of agents the ingest route is nearly
all of the supervisor's requests, and each layer of the stack (body limits, JSON bodies,
cookies, ETags, request metrics, security headers, routing, dependency resolution) costs it
time per request that none of them needs to spend on it; so do FastAPI's own layers (its
error pages, its telemetry, its body limit), together a noticeable share of each ingest
request's time.  This middleware is the app's ``front``
(``trainwarden.supervisor.server.app.SupervisorApp``), ahead of them all, and does for the ingest
route what those layers would, once:

* the body limit (``server.max_body_bytes``): 413 from the declared length or the bytes read;
* the token check (``TokenCheck("agent")``, the route's dependency): 401/403 as the route;
* the route's work (``agents.store_batch``), its errors rendered as FastAPI renders them;
* the security headers (``trainwarden.supervisor.server.headers``) on every answer;
* the request counter and the ingest latency histogram
  (``trainwarden.supervisor.observability.metrics``);
* an unexpected error: 500, logged with its traceback (FastAPI's error layer).

Any other request, and any other method on the path, goes down the whole stack.
"""

from __future__ import annotations

import logging
import time
from collections.abc import MutableMapping
from typing import Any

from fastapi import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from trainwarden.supervisor.api.agents import store_batch
from trainwarden.supervisor.api.deps import TokenCheck
from trainwarden.supervisor.contract.limits import (
    body_too_large,
    refuse_body,
    refused_declared_length,
)
from trainwarden.supervisor.observability.metrics import INGEST_PATH, RequestCounters
from trainwarden.supervisor.server.headers import HEADERS

log = logging.getLogger("trainwarden.ingest")

_AGENT = TokenCheck("agent")


class _Disconnected(Exception):
    pass


class IngestPath:
    def __init__(self, app: Any, *, max_bytes: int, counters: RequestCounters) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.counters = counters

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope.get("path") != INGEST_PATH
                or scope.get("method") != "POST"):
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500
        started = False

        async def secured_send(message: MutableMapping[str, Any]) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = int(message["status"]), True
                headers = list(message.get("headers") or [])
                have = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in HEADERS if k not in have]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self._answer(scope, receive, secured_send)
        except _Disconnected:
            status = 499  # the client went away before its body arrived: nothing stored
        except Exception:
            # What FastAPI's error layer would do, which this path is ahead of: a 500 (the
            # agent keeps the batch and sends it again) and the traceback in the log.
            log.exception("ingest request failed")
            if not started:
                await JSONResponse({"detail": "Internal Server Error"}, status_code=500)(
                    scope, receive, secured_send)
            status = 500
        finally:
            self.counters.count("POST", INGEST_PATH, status)
            self.counters.ingest_latency(time.perf_counter() - t0)

    async def _answer(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if await refused_declared_length(scope, send, self.max_bytes):
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                await refuse_body(send, 413, body_too_large(seen, self.max_bytes))
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        request = Request(scope)
        response: Response
        try:
            principal = await _AGENT(request)
            response = await store_batch(request, b"".join(chunks), principal)
        except HTTPException as e:  # as FastAPI's handler renders it
            response = JSONResponse({"detail": e.detail}, status_code=e.status_code,
                                    headers=e.headers)
        await response(scope, receive, send)

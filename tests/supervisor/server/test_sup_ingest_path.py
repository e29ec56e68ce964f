"""``POST /api/v1/ingest`` is answered ahead of the middleware stack (``IngestPath``): it
must still do everything the stack did for it (limits, auth, headers, metrics, errors)."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from tests.supervisor.sup_helpers import (
    AGENT,
    OPERATOR,
    as_agent,
    count_rows,
    ingest,
    register,
    step,
)
from trainwarden.supervisor.observability.metrics import INGEST_PATH, RequestCounters
from trainwarden.supervisor.server.headers import HEADERS
from trainwarden.supervisor.server.ingest_path import IngestPath
from trainwarden.supervisor.store.db import Database


def _metric(client: TestClient, prefix: str) -> float:
    """The value of the one /metrics sample line starting with ``prefix`` (0: none)."""
    text = client.get("/metrics", headers=OPERATOR).text
    lines = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    assert len(lines) <= 1, lines
    return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0


def test_ingest_answers_carry_the_security_headers(client: TestClient) -> None:
    aid = register(client)["agent_id"]
    ok = client.post("/api/v1/ingest", headers={**AGENT, "content-type": "application/json"},
                     content=json.dumps({"agent_id": aid, "seq": 0, "items": []}))
    refused = client.post("/api/v1/ingest", content=b"{}")  # no token: 401
    for r in (ok, refused):
        for name, value in HEADERS:
            assert r.headers.get(name.decode()) == value.decode(), (r.status_code, name)


def test_ingest_without_a_valid_token_is_refused_and_stores_nothing(
        client: TestClient, db: Database) -> None:
    aid = register(client)["agent_id"]
    body = json.dumps({"agent_id": aid, "seq": 0, "items": [step(0, 1)]})
    r = client.post("/api/v1/ingest", content=body)
    assert r.status_code == 401
    assert r.json()["detail"].startswith("missing bearer token")
    assert r.headers["www-authenticate"] == "Bearer"
    r = client.post("/api/v1/ingest", content=body, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert r.json()["detail"].startswith("invalid token")
    # the agent token without the agent's credential: 403, told to register again
    r = client.post("/api/v1/ingest", content=body, headers=AGENT)
    assert r.status_code == 403
    assert r.headers.get("x-trainwarden-credential") == "invalid"
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 0


def test_ingest_requests_are_counted_and_timed(client: TestClient) -> None:
    aid = register(client)["agent_id"]
    route = f'trainwarden_http_requests_total{{method="POST",route="{INGEST_PATH}"'
    ingest(client, aid, 0, [step(0, 1)])
    ingest(client, aid, 1, [step(0, 2)])
    client.post("/api/v1/ingest", content=b"{}")  # 401
    assert _metric(client, route + ',status="200"}') == 2
    assert _metric(client, route + ',status="401"}') == 1
    assert _metric(client, "trainwarden_ingest_latency_seconds_count") == 3


def test_other_methods_on_the_ingest_path_reach_the_router(client: TestClient) -> None:
    r = client.get("/api/v1/ingest", headers=AGENT)
    assert r.status_code == 405
    assert r.headers.get("x-content-type-options") == "nosniff"


def test_unknown_agent_and_bad_body_render_as_the_route_did(client: TestClient) -> None:
    register(client)
    r = client.post("/api/v1/ingest", headers={**AGENT, "content-type": "application/json"},
                    content=json.dumps({"agent_id": 999, "seq": 0, "items": []}))
    assert r.status_code == 404
    assert "register first" in r.json()["detail"]
    r = client.post("/api/v1/ingest", headers={**AGENT, "content-type": "application/json"},
                    content=json.dumps({"agent_id": "x", "seq": 0}))
    assert r.status_code == 422
    assert r.json()["errors"][0]["loc"] == ["body", "agent_id"]


def test_ingest_is_answered_ahead_of_fastapis_own_layers(app: FastAPI,
                                                         client: TestClient) -> None:
    """FastAPI's error, telemetry and body-limit layers cost the ingest request 18% of its
    time at 2,048 agents: an ingest never enters the app's stack, any other request does."""
    aid = register(client)["agent_id"]
    entered: list[str] = []
    stack = app.middleware_stack
    assert stack is not None  # (built by the first request)

    async def recorder(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            entered.append(scope["path"])
        await stack(scope, receive, send)

    app.middleware_stack = recorder
    ingest(client, aid, 0, [step(0, 1)])
    assert entered == []
    assert client.get("/healthz").status_code == 200
    assert entered == ["/healthz"]


def test_an_unexpected_error_is_a_500_and_the_next_batch_is_stored(
        app: FastAPI, client: TestClient, db: Database,
        caplog: pytest.LogCaptureFixture) -> None:
    """What FastAPI's error layer did ahead of which the ingest path now runs: a 500 the agent
    retries (nothing stored), the traceback logged, the server going on."""
    aid = register(client)["agent_id"]
    writer = app.state.ingest_writer
    real = writer.submit

    async def broken(batch: Any) -> Any:
        raise RuntimeError("disk on fire")

    writer.submit = broken
    body = json.dumps({"agent_id": aid, "seq": 0, "items": [step(0, 1)]})
    with caplog.at_level(logging.ERROR, logger="trainwarden.ingest"):
        r = client.post("/api/v1/ingest", content=body,
                        headers={**as_agent(client, aid), "content-type": "application/json"})
    assert r.status_code == 500
    assert r.json() == {"detail": "Internal Server Error"}
    assert r.headers.get("x-content-type-options") == "nosniff"
    assert any("disk on fire" in (rec.exc_text or "") for rec in caplog.records)
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 0
    writer.submit = real
    ingest(client, aid, 0, [step(0, 1)])  # the agent's retry of the same batch
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 1
    assert _metric(client, f'trainwarden_http_requests_total{{method="POST",route="{INGEST_PATH}"'
                           ',status="500"}') == 1


# ---- the middleware alone (raw ASGI): what a client cannot make TestClient send


class _Inner:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.calls.append((scope["method"], scope["path"]))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})


def _call(mw: IngestPath, scope: dict[str, Any], messages: list[dict[str, Any]]
          ) -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    pending = list(messages)

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(mw(scope, receive, send))
    return sent


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]] | None = None
           ) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "headers": headers or [],
            "query_string": b"", "root_path": ""}


def _middleware(max_bytes: int = 100) -> tuple[IngestPath, _Inner, RequestCounters]:
    inner = _Inner()
    counters = RequestCounters(CollectorRegistry())
    return IngestPath(inner, max_bytes=max_bytes, counters=counters), inner, counters


def test_other_requests_pass_through_untouched() -> None:
    mw, inner, _ = _middleware()
    for method, path in (("GET", "/api/v1/runs"), ("GET", INGEST_PATH),
                         ("POST", "/api/v1/agents/register")):
        sent = _call(mw, _scope(method, path), [])
        assert sent[0]["status"] == 204
    assert inner.calls == [("GET", "/api/v1/runs"), ("GET", INGEST_PATH),
                           ("POST", "/api/v1/agents/register")]


def test_declared_length_over_the_limit_is_413_before_reading() -> None:
    mw, inner, counters = _middleware(max_bytes=100)
    sent = _call(mw, _scope("POST", INGEST_PATH, [(b"content-length", b"101")]), [])
    assert sent[0]["status"] == 413
    assert "over the limit of 100 bytes" in json.loads(sent[1]["body"])["detail"]
    assert inner.calls == []
    assert counters.requests.labels("POST", INGEST_PATH, "413")._value.get() == 1


def test_a_content_length_that_is_not_a_number_is_400() -> None:
    mw, _, _ = _middleware()
    sent = _call(mw, _scope("POST", INGEST_PATH, [(b"content-length", b"ten")]), [])
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["detail"] == "Content-Length is not a number"


def test_a_streamed_body_over_the_limit_is_413() -> None:
    mw, inner, _ = _middleware(max_bytes=100)
    chunks = [{"type": "http.request", "body": b"x" * 60, "more_body": True},
              {"type": "http.request", "body": b"x" * 60, "more_body": False}]
    sent = _call(mw, _scope("POST", INGEST_PATH), chunks)
    assert sent[0]["status"] == 413
    assert inner.calls == []


def test_a_client_gone_before_its_body_is_counted_and_answered_nothing() -> None:
    mw, _, counters = _middleware()
    sent = _call(mw, _scope("POST", INGEST_PATH),
                 [{"type": "http.request", "body": b"{", "more_body": True}])
    assert sent == []
    assert counters.requests.labels("POST", INGEST_PATH, "499")._value.get() == 1

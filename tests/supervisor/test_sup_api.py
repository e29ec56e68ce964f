"""HTTP API on SQLite and Postgres: ingest, idempotency, auth, bad input, reads."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    AGENT,
    OPERATOR,
    count_rows,
    ingest,
    register,
    step,
    stored_rank_steps,
)
from trainwarden.supervisor.store.db import Database


def counts(db: Database) -> dict[str, int]:
    with db.read() as c:
        return {t: count_rows(c, t)
                for t in ("rank_steps", "step_aggregates", "events", "checkpoints", "exits",
                          "ingested_batches")}


def test_register_is_stable_and_reports_next_seq(client: TestClient) -> None:
    a = register(client, node="n0")
    assert a["attempt"] == 0 and a["next_seq"] == 0 and a["heartbeat_interval_s"] == 1.0
    ingest(client, a["agent_id"], 0, [step(0, 0)])
    ingest(client, a["agent_id"], 1, [step(0, 1)])
    again = register(client, node="n0")
    assert again["agent_id"] == a["agent_id"] and again["next_seq"] == 2
    assert register(client, node="n1")["agent_id"] != a["agent_id"]


def test_replayed_batch_is_stored_once(client: TestClient, db: Database) -> None:
    aid = register(client)["agent_id"]
    items = [step(0, 5), step(1, 5),
             {"type": "event", "rank": 0, "name": "worker_started", "t": 1.0},
             {"type": "checkpoint", "rank": 0, "step": 5, "path": "/ck/5", "bytes": 10,
              "lineage": "a0", "t": 2.0}]
    first = ingest(client, aid, 7, items)
    assert first == {"seq": 7, "duplicate": False, "attempt": 0, "commands": [], "protect": [],
                     "role": "member", "epoch": 0}
    before = counts(db)
    second = ingest(client, aid, 7, items)
    assert second["duplicate"] is True and second["seq"] == 7
    assert counts(db) == before
    assert before["rank_steps"] == 2 and before["ingested_batches"] == 1
    pts = client.get("/api/v1/runs/r1/steps", headers=OPERATOR).json()["points"]
    assert len(pts) == 1 and pts[0]["ranks"] == 2  # the aggregate was not counted twice


def test_nan_loss_survives_and_aggregates_merge_across_agents(client: TestClient) -> None:
    a0 = register(client, node="n0")["agent_id"]
    a1 = register(client, node="n1")["agent_id"]
    ingest(client, a0, 0, [step(0, 3, loss=1.0, step_s=0.2), step(1, 3, loss=float("nan"))])
    ingest(client, a1, 0, [step(2, 3, loss=3.0, step_s=0.9), step(3, 3, loss=5.0)])
    pts = client.get("/api/v1/runs/r1/steps", headers=OPERATOR).json()["points"]
    assert len(pts) == 1
    p = pts[0]
    assert p["ranks"] == 4 and p["loss_nonfinite"] == 1
    assert p["loss_min"] == 1.0 and p["loss_max"] == 5.0 and p["loss_mean"] == 3.0
    assert p["samples"] == 32 and p["tokens"] == 4096 and p["step_s_max"] == 0.9
    ranks = client.get("/api/v1/runs/r1/ranks", headers=OPERATOR).json()["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert ranks[1]["loss"] == "NaN"  # kept, spelled as a string for JSON readers
    assert ranks[2]["node"] == "n1" and ranks[2]["step_s"] == 0.9


def test_nan_kept_in_rank_rows(client: TestClient, db: Database) -> None:
    aid = register(client)["agent_id"]
    ingest(client, aid, 0, [step(0, 1, loss=float("nan"), grad_norm=float("inf"))])
    with db.read() as c:
        rows = stored_rank_steps(c, run_id=1)
    assert math.isnan(rows[0]["loss"]) and rows[0]["grad_norm"] == math.inf


def test_ranks_keep_latest_step(client: TestClient) -> None:
    aid = register(client)["agent_id"]
    ingest(client, aid, 0, [step(0, 2, step_s=0.5)])
    ingest(client, aid, 1, [step(0, 1, step_s=9.0)])  # out of order: older step
    r = client.get("/api/v1/runs/r1/ranks", headers=OPERATOR).json()["ranks"][0]
    assert r["step"] == 2 and r["step_s"] == 0.5


def test_steps_downsampled_on_the_server(client: TestClient) -> None:
    aid = register(client)["agent_id"]
    ingest(client, aid, 0, [step(0, s, loss=float(s)) for s in range(100)])
    pts = client.get("/api/v1/runs/r1/steps?max_points=10", headers=OPERATOR).json()["points"]
    assert len(pts) == 10
    assert pts[0]["step_from"] == 0 and pts[0]["step_to"] == 9
    assert pts[0]["loss_min"] == 0.0 and pts[0]["loss_max"] == 9.0 and pts[0]["loss_mean"] == 4.5
    ranged = client.get("/api/v1/runs/r1/steps?from=20&to=29", headers=OPERATOR).json()["points"]
    assert [p["step_from"] for p in ranged] == list(range(20, 30))
    bad = client.get("/api/v1/runs/r1/steps?from=20&to=10", headers=OPERATOR)
    assert bad.status_code == 422 and "below" in bad.json()["detail"]


def test_run_summary(client: TestClient) -> None:
    aid = register(client)["agent_id"]
    for s in range(5):
        ingest(client, aid, s, [step(0, s, t=100.0 + s)])
    ingest(client, aid, 5, [{"type": "checkpoint", "step": 4, "path": "/ck/4", "bytes": 99,
                             "t": 150.0, "lineage": "a0"}])
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["status"] == "running" and run["attempt"] == 0 and run["step"] == 4
    assert run["restarts"] == 0
    assert run["throughput"]["steps_per_s"] == pytest.approx(1.0)
    assert run["throughput"]["samples_per_s"] == pytest.approx(8.0)
    assert run["checkpoint"]["path"] == "/ck/4"
    assert client.get("/api/v1/runs", headers=OPERATOR).json()["runs"][0]["name"] == "r1"
    for what in ("checkpoints", "incidents", "actions", "events"):
        r = client.get(f"/api/v1/runs/r1/{what}", headers=OPERATOR)
        assert r.status_code == 200 and what in r.json()


def test_unknown_run_and_agent_are_404(client: TestClient) -> None:
    for what in ("", "/steps", "/ranks", "/checkpoints", "/incidents", "/actions", "/events"):
        r = client.get(f"/api/v1/runs/nope{what}", headers=OPERATOR)
        assert r.status_code == 404 and "nope" in r.json()["detail"]
    r = client.post("/api/v1/ingest", headers=AGENT, json={"agent_id": 42, "seq": 0, "items": []})
    assert r.status_code == 404 and "register first" in r.json()["detail"]


@pytest.mark.parametrize("body, needle", [
    ({"agent_id": 1, "seq": -1, "items": []}, "seq"),
    ({"agent_id": 1, "seq": 0, "items": [{"type": "bogus"}]}, "bogus"),
    ({"agent_id": 1, "seq": 0, "items": [{"type": "step", "rank": 0}]}, "step"),
    ({"agent_id": 1, "seq": 0, "items": [{"type": "exit", "outcome": "exploded"}]}, "outcome"),
    ({"seq": 0, "items": []}, "agent_id"),
])
def test_bad_batch_is_refused_and_nothing_stored(
    client: TestClient, db: Database, body: dict[str, object], needle: str
) -> None:
    aid = register(client)["agent_id"]
    assert aid == 1
    before = counts(db)  # (the registration's own event)
    # A valid item first: the whole batch must be refused, not a prefix of it stored.
    if body.get("items"):
        body = {**body, "items": [step(0, 0), *body["items"]]}  # type: ignore[misc]
    r = client.post("/api/v1/ingest", headers=AGENT, json=body)
    assert r.status_code == 422, r.text
    assert needle in r.json()["detail"]
    assert counts(db) == before


def test_malformed_json_is_422(client: TestClient) -> None:
    r = client.post("/api/v1/ingest", headers={**AGENT, "content-type": "application/json"},
                    content=b"{not json")
    assert r.status_code == 422 and "invalid request" in r.json()["detail"]


def test_oversized_body_is_413(client: TestClient, db: Database) -> None:
    aid = register(client)["agent_id"]
    before = counts(db)  # (the registration's own event)
    items = [step(0, s, message="x" * 100) for s in range(1000)]  # > 64 KiB in the fixture
    body = json.dumps({"agent_id": aid, "seq": 0, "items": items}).encode()
    r = client.post("/api/v1/ingest", headers={**AGENT, "content-type": "application/json"},
                    content=body)
    assert r.status_code == 413 and "over the limit" in r.json()["detail"]

    def chunks():  # no Content-Length: counted while streaming
        for i in range(0, len(body), 8192):
            yield body[i:i + 8192]

    r = client.post("/api/v1/ingest", headers={**AGENT, "content-type": "application/json"},
                    content=chunks())
    assert r.status_code == 413
    assert counts(db) == before


def test_auth(client: TestClient) -> None:
    reg = {"run": "r1", "node": "n0"}
    r = client.post("/api/v1/agents/register", json=reg)
    assert r.status_code == 401 and "missing bearer token" in r.json()["detail"]
    assert r.headers["www-authenticate"] == "Bearer"
    r = client.post("/api/v1/agents/register", json=reg, headers={"Authorization": "Bearer x"})
    assert r.status_code == 401 and r.json()["detail"] == "invalid token"
    assert client.post("/api/v1/agents/register", json=reg, headers=OPERATOR).status_code == 200
    # reads need a token unless public_reads
    assert client.get("/api/v1/runs").status_code == 401
    assert client.get("/api/v1/runs", headers=AGENT).status_code == 200
    # operator-only route refuses the agent token
    r = client.post("/api/v1/runs/r1/stop", json={"reason": "x"}, headers=AGENT)
    assert r.status_code == 403 and "operator" in r.json()["detail"]
    assert client.get("/healthz").json() == {"status": "ok"}


def test_public_reads(db: Database, clock: object) -> None:
    from tests.supervisor.sup_helpers import make_settings
    from trainwarden.supervisor.server.app import create_app

    app = create_app(make_settings(public_reads=True), db=db, clock=clock,  # type: ignore[arg-type]
                     upgrade_schema=False, start_evaluator=False)
    with TestClient(app) as c:
        assert c.get("/api/v1/runs").status_code == 200
        assert c.post("/api/v1/agents/register", json={"run": "r", "node": "n"}).status_code == 401
        assert c.get("/api/v1/runs", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_store_dependency_can_be_overridden(client: TestClient, db: Database) -> None:
    from trainwarden.supervisor.api.deps import get_db

    calls = []

    async def fake_db() -> Database:
        calls.append(1)
        return db

    client.app.dependency_overrides[get_db] = fake_db  # type: ignore[attr-defined]
    assert client.get("/api/v1/runs", headers=OPERATOR).status_code == 200
    assert calls


def test_openapi_docs(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    assert "/api/v1/ingest" in spec["paths"] and "/api/v1/runs/{run}/steps" in spec["paths"]
    assert client.get("/docs").status_code == 200

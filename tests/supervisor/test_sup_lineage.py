"""After a rollback, every per-step figure is the final lineage's: one attempt's rows per step
(the attempt whose history continues to the present), never the superseded attempt's rows
merged in, on SQLite and Postgres through the real app."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.supervisor.sup_helpers import (
    OPERATOR,
    ingest,
    run_with_checkpoints,
    step,
)
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store import windows
from trainwarden.supervisor.store.db import Database

SPIKE, HEALTHY = 13_460.0, 0.06


def rolled_back_run(client: TestClient, evaluator: Evaluator) -> None:
    """Attempt 0 trains steps 0-129 (loss 2.0 and 3.0 on its two ranks), is rolled back to
    its checkpoint at step 100, and trains on through step 159 (spiking) before the restart
    reaches it; attempt 1 resumes at step 100 and trains steps 100-139 (loss 0.06)."""
    a = run_with_checkpoints(client)
    r = client.post("/api/v1/runs/r1/rollback", headers=OPERATOR,
                    json={"step": 100, "skip": [[100, 129]], "reason": "loss spike"})
    assert r.status_code == 202, r.text
    (cmd,) = ingest(client, a, 1, [])["commands"]
    # The old workers have not stopped yet: steps 130-159 of attempt 0, the spike going on.
    ingest(client, a, 2, [step(rk, s, world_size=2, loss=SPIKE) for s in range(130, 160)
                          for rk in (0, 1)])
    ack = {"type": "command_result", "t": 1.0, "command_id": cmd["id"]}
    ingest(client, a, 3, [{**ack, "status": "delivered"}, {**ack, "status": "done"}])
    ingest(client, a, 4, [step(rk, s, attempt=1, world_size=2, loss=HEALTHY,
                               batch_index=s + 30, t=400.0 + s)
                          for s in range(100, 140) for rk in (0, 1)], attempt=1)
    evaluator.tick()


def points(client: TestClient, query: str = "") -> dict[str, Any]:
    r = client.get(f"/api/v1/runs/r1/steps{query}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_steps_after_a_rollback_are_the_final_lineage(
        client: TestClient, evaluator: Evaluator) -> None:
    rolled_back_run(client, evaluator)
    body = points(client)
    pts = body["points"]
    # One point per step: attempt 0 up to the rollback point, attempt 1 from it on; the
    # superseded steps 100-159 of attempt 0 are not merged into them.
    assert [p["step_from"] for p in pts] == list(range(140))
    assert {p["step_from"]: p["attempt"] for p in pts} == {
        s: 0 if s < 100 else 1 for s in range(140)}
    assert all(p["rows"] == 1 and p["ranks"] == 2 and p["samples"] == 16 for p in pts)
    assert {p["loss_mean"] for p in pts if p["step_from"] >= 100} == {HEALTHY}
    assert {p["loss_mean"] for p in pts if p["step_from"] < 100} == {2.5}
    # The superseded attempt is drawn apart: its own steps after the rollback point.
    sup = body["superseded"]
    assert [(p["attempt"], p["step_from"]) for p in sup] == [(0, s) for s in range(100, 160)]
    assert {p["loss_mean"] for p in sup if p["step_from"] >= 130} == {SPIKE}


def test_bucketed_steps_after_a_rollback_are_the_final_lineage(
        client: TestClient, evaluator: Evaluator) -> None:
    rolled_back_run(client, evaluator)
    body = points(client, "?max_points=14")
    pts = body["points"]
    assert [(p["step_from"], p["step_to"]) for p in pts] == [
        (s, s + 9) for s in range(0, 140, 10)]
    # Ten steps a bucket, each of one attempt: ten rows, 2 ranks and 16 samples a step.
    assert all(p["rows"] == 10 and p["ranks"] == 20 and p["samples"] == 160 for p in pts)
    assert [p["loss_mean"] for p in pts[10:]] == pytest.approx([HEALTHY] * 4)
    assert [p["attempt"] for p in pts] == [0] * 10 + [1] * 4
    sup = body["superseded"]
    assert {p["attempt"] for p in sup} == {0}
    assert sum(p["rows"] for p in sup) == 60  # steps 100-159, in buckets of their own
    assert max(p["loss_max"] for p in sup) == SPIKE


def test_one_attempts_steps_are_its_own(client: TestClient, evaluator: Evaluator) -> None:
    rolled_back_run(client, evaluator)
    old = points(client, "?attempt=0")
    assert [p["step_from"] for p in old["points"]] == list(range(160))
    assert old["superseded"] == []
    new = points(client, "?attempt=1")
    assert [p["step_from"] for p in new["points"]] == list(range(100, 140))


def test_a_rollback_decided_supersedes_the_old_steps_before_the_new_attempt_reports(
        client: TestClient) -> None:
    a = run_with_checkpoints(client)
    assert client.post("/api/v1/runs/r1/rollback", headers=OPERATOR,
                       json={"step": 100}).status_code == 202
    ingest(client, a, 1, [step(rk, s, world_size=2, loss=SPIKE) for s in range(130, 140)
                          for rk in (0, 1)])
    body = points(client)
    assert [p["step_from"] for p in body["points"]] == list(range(100))
    assert [p["step_from"] for p in body["superseded"]] == list(range(100, 140))


def test_a_step_trained_twice_is_one_point_when_bucketed_one_step_a_bucket(
        client: TestClient, evaluator: Evaluator) -> None:
    """The dashboard asks for 1000 points: a run of fewer steps than that, with more rows
    (two attempts), is bucketed one step a bucket; a bucket is one attempt's step, never
    the mean of the spike and the healthy loss (the demo's 6,730 = (13,460 + 0.06) / 2)."""
    rolled_back_run(client, evaluator)
    pts = points(client, "?max_points=160")["points"]
    assert [p["step_from"] for p in pts] == list(range(140))
    assert all(p["rows"] == 1 and p["ranks"] == 2 and p["samples"] == 16 for p in pts)
    assert {p["loss_mean"] for p in pts if p["step_from"] >= 100} == {HEALTHY}


def test_metrics_and_the_detectors_window_read_the_final_lineage(
        client: TestClient, evaluator: Evaluator, db: Database) -> None:
    """While the rollback is under way (attempt 1 has not reported), ``/metrics`` says the
    lineage's newest step and loss, not the old attempt's spike; once attempt 1 trains, the
    loss and throughput detectors judge its steps after attempt 0's up to the rollback
    point, and none of the superseded ones."""
    a = run_with_checkpoints(client)
    assert client.post("/api/v1/runs/r1/rollback", headers=OPERATOR,
                       json={"step": 100}).status_code == 202
    ingest(client, a, 1, [step(rk, s, world_size=2, loss=SPIKE) for s in range(130, 140)
                          for rk in (0, 1)])
    text = client.get("/metrics", headers=OPERATOR).text
    gauges = {s.name: s.value for fam in text_string_to_metric_families(text)
              for s in fam.samples if s.labels.get("run") == "r1"}
    assert gauges["trainwarden_run_step"] == 99 and gauges["trainwarden_run_loss"] == 2.5
    ingest(client, a, 2, [step(rk, s, attempt=1, world_size=2, loss=HEALTHY,
                               batch_index=s + 30) for s in range(100, 110)
                          for rk in (0, 1)], attempt=1)
    with db.read() as conn:
        rows = windows.loss_series(conn, run_id=1, attempt=1, limit=50)
    assert [(r["attempt"], r["step"]) for r in rows] == (
        [(0, s) for s in range(60, 100)] + [(1, s) for s in range(100, 110)])
    assert max(r["loss"] for r in rows) == 2.5

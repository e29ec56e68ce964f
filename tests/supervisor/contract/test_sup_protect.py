"""Checkpoint protection: what the workers' retention must keep, decided by the policy,
published by the evaluator, carried to the agents by every ingest reply."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import OPERATOR, FakeClock, ingest, run_with_checkpoints, step
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry
from trainwarden.supervisor.store.db import Database

CFG = policy.PolicyConfig(rollback_margin_steps=10)
CKPTS = ((50, 150.0, "/ck/step_50"), (100, 200.0, "/ck/step_100"),
         (125, 225.0, "/ck/step_125"))


def protect(**kw: Any) -> list[str]:
    return policy.protected_checkpoints(policy.ProtectFacts(checkpoints=CKPTS, **kw), CFG)


def test_nothing_open_protects_nothing_beyond_what_retention_keeps() -> None:
    assert protect() == []


def test_an_open_incident_protects_the_last_good_checkpoint_before_it() -> None:
    # A straggler from step 120: the newest checkpoint at or before it.
    assert protect(open_incidents=(("straggler", 120, 300.0),)) == ["/ck/step_100"]
    assert protect(open_incidents=(("straggler", 125, 300.0),)) == ["/ck/step_125"]
    # A loss spike at 120: the one a rollback would take, margin steps before it.
    assert protect(open_incidents=(("loss_spike", 120, 300.0),)) == ["/ck/step_100"]
    assert protect(open_incidents=(("nonfinite", 109, 300.0),)) == ["/ck/step_50"]
    # No step: the newest saved before the incident opened.
    assert protect(open_incidents=(("node_lost", None, 210.0),)) == ["/ck/step_100"]
    # Nothing before it: nothing to protect for it.
    assert protect(open_incidents=(("straggler", 20, 300.0),)) == []


def test_pending_restart_targets_are_protected_and_the_list_is_bounded() -> None:
    assert protect(pending_targets=("/ck/step_50",),
                   open_incidents=(("straggler", 120, 300.0),)) == ["/ck/step_100",
                                                                   "/ck/step_50"]
    many = tuple(f"/ck/step_{i}" for i in range(40))
    assert len(protect(pending_targets=many)) == policy.PROTECT_MAX


def test_the_evaluator_publishes_protection_and_ingest_replies_carry_it(
        client: TestClient, evaluator: Evaluator, db: Database, clock: FakeClock) -> None:
    a = run_with_checkpoints(client)
    assert ingest(client, a, 1, [])["protect"] == []
    with db.write() as conn:
        run = registry.get_run_by_name(conn, name="r1")
        assert run is not None
        inc = rec.open_incident(conn, run_id=run["id"], kind="straggler", cause="slow rank 1",
                                 attempt=0, rank=1, step=110,
                                 details={"flagged_at_step": 129}, opened_at=clock(),
                                 updated_at=clock())
    evaluator.tick()
    assert ingest(client, a, 2, [])["protect"] == ["/ck/step_100"]
    # An operator rollback to step 50 abandons 100 and 125: the incident's last good
    # checkpoint on the current lineage, and the restart's target, is step 50.
    r = client.post("/api/v1/runs/r1/rollback", json={"step": 50, "reason": "bad data"},
                    headers=OPERATOR)
    assert r.status_code == 202, r.text
    evaluator.tick()
    assert ingest(client, a, 3, [])["protect"] == ["/ck/step_50"]
    # The incident resolved: the pending restart still needs its target.
    with db.write() as conn:
        rec.resolve_incident(conn, incident_id=inc, now=clock())
    evaluator.tick()
    (cmd,) = ingest(client, a, 4, [])["commands"]
    assert ingest(client, a, 5, [])["protect"] == ["/ck/step_50"]
    # The restart resumed: nothing beyond the newest few to keep any more.
    ack = {"type": "command_result", "t": 1.0, "command_id": cmd["id"]}
    ingest(client, a, 6, [{**ack, "status": "delivered"}, {**ack, "status": "done"}])
    ingest(client, a, 7, [step(0, 50, attempt=1, batch_index=50)], attempt=1)
    evaluator.tick()
    assert ingest(client, a, 8, [], attempt=1)["protect"] == []
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).json()["protected"] == []

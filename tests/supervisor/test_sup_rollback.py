"""Recovery: the rollback policy for loss spikes and NaN, and the operator's rollback API."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    AGENT,
    OPERATOR,
    FakeClock,
    count_rows,
    ingest,
    run_with_checkpoints,
    step,
)
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store.db import Database

CFG = policy.PolicyConfig(rollback_budget=2, rollback_margin_steps=10, rollback_skip_before=5,
                          rollback_skip_batches=40, rollback_lr_scale=0.5,
                          rollback_lr_steps=30, rollback_lr_ramp_steps=10)
RUN = policy.RunFacts(id=1, name="r", status="running", attempt=0, restarts=0)


# What a user gets: the skip and the LR reduction sized from what was observed.
DEFAULT = policy.PolicyConfig(rollback_budget=2)


def spike(step: int = 120, kind: str = "loss_spike", attempt: int = 0, **details: Any
          ) -> policy.FindingFacts:
    return policy.FindingFacts(kind=kind, severity="incident", message="loss spike",
                               attempt=attempt, step=step, details=details)


def rec(done: int = 0, **kw: Any) -> policy.RecoveryFacts:
    base: dict[str, Any] = {
        "checkpoints": ((50, "/ck/step_50"), (100, "/ck/step_100"), (125, "/ck/step_125")),
        "batch_index": {50: 50, 100: 100, 120: 120}, "restarts_by_cause": {"spike": done},
        "high_step": 130, "high_at_restarts": ()}
    base.update(kw)
    return policy.RecoveryFacts(**base)


def decide(f: policy.FindingFacts, r: policy.RecoveryFacts, run: policy.RunFacts = RUN,
           cfg: policy.PolicyConfig = CFG) -> Any:
    return policy.on_finding(run, f, incident_kinds_this_attempt=frozenset(),
                             open_watch=frozenset(), checkpoint="/ck/step_125", cfg=cfg,
                             now=10.0, recovery=r)


def test_default_skip_runs_from_before_the_spike_through_where_it_was_detected() -> None:
    # Started at 120, not back within the window: detected at 170.  Batches 110-170 were
    # seen bad (and a few before); the LR is lowered for a quarter of that, back over half.
    d = decide(spike(120, detected_at_step=170), rec(batch_index={100: 100, 120: 120, 170: 170}),
               cfg=DEFAULT)
    assert isinstance(d, policy.Restart) and d.rollback_to_step == 100
    assert d.skip == ((110, 170),)
    assert d.lr is not None and (d.lr.scale, d.lr.steps, d.lr.ramp_steps) == (0.5, 16, 8)
    assert "detected at step 170" in d.reason and "skip batches 110-170" in d.reason


def test_default_skip_and_lr_steps_grow_when_the_spike_comes_back() -> None:
    d = decide(spike(120, attempt=1, detected_at_step=170),
               rec(done=1, batch_index={100: 100, 120: 120, 170: 170}),
               RUN.__class__(1, "r", "running", 1, 1), cfg=DEFAULT)
    assert isinstance(d, policy.Restart)
    assert d.skip == ((110, 231),)  # twice the 61 batches
    assert d.lr is not None and (d.lr.scale, d.lr.steps, d.lr.ramp_steps) == (0.25, 31, 15)


def test_default_skip_follows_batch_indices_to_the_detection_point() -> None:
    # A skip range between the spike and its detection: the batch trained at 170 is 260.
    d = decide(spike(120, detected_at_step=170),
               rec(batch_index={100: 140, 120: 160, 170: 260}), cfg=DEFAULT)
    assert isinstance(d, policy.Restart) and d.skip == ((150, 260),)


def test_default_nan_skips_the_nan_batch_and_a_few_before() -> None:
    d = decide(spike(120, kind="nonfinite"), rec(), cfg=DEFAULT)
    assert isinstance(d, policy.Restart) and d.skip == ((110, 120),)
    assert d.lr is not None and (d.lr.steps, d.lr.ramp_steps) == (3, 1)


def test_default_nan_after_a_climb_skips_from_where_the_climb_started() -> None:
    d = decide(spike(120, kind="nonfinite", start_step=112),
               rec(batch_index={100: 100, 112: 112, 120: 120}), cfg=DEFAULT)
    assert isinstance(d, policy.Restart) and d.rollback_to_step == 100  # <= 112 - 10
    assert d.skip == ((102, 120),)


def test_rollback_settings_are_validated_with_the_fix_named() -> None:
    with pytest.raises(ValueError,
                       match=r"^rollback\.skip_batches must be >= 1 \(got 0\); or leave it unset"):
        policy.PolicyConfig(rollback_skip_batches=0)
    with pytest.raises(ValueError,
                       match=r"^rollback\.lr_ratio must be >= 0 \(got -1\); 0: no LR reduction$"):
        policy.PolicyConfig(rollback_lr_ratio=-1)


def test_fixed_skip_and_lr_settings_apply_as_set() -> None:
    d = decide(spike(120, detected_at_step=170), rec())
    assert isinstance(d, policy.Restart) and d.cause == "spike"
    assert d.checkpoint == "/ck/step_100" and d.rollback_to_step == 100  # <= 120 - 10
    assert d.skip == ((115, 154),)  # from 5 before the spike's batch, 40 batches
    assert d.lr is not None and (d.lr.scale, d.lr.steps, d.lr.ramp_steps) == (0.5, 30, 10)
    assert d.not_before == 10.0 and d.attempt == 1
    plan = d.plan(action_id=3)
    assert plan["skip"] == [[115, 154]] and plan["lr"]["scale"] == 0.5
    assert "roll back to step 100" in d.reason


def test_fixed_skip_follows_batch_indices_not_steps() -> None:
    # Steps and batch indices differ once batches were skipped before.
    d = decide(spike(120), rec(batch_index={100: 140, 120: 160}))
    assert isinstance(d, policy.Restart) and d.skip == ((155, 194),)


def test_recurring_spike_widens_a_fixed_skip_and_lowers_the_lr_further_then_stops() -> None:
    d = decide(spike(120, attempt=1), rec(done=1), RUN.__class__(1, "r", "running", 1, 1))
    assert isinstance(d, policy.Restart)
    assert d.skip == ((115, 194),) and d.lr is not None and d.lr.scale == 0.25
    assert "the spike came back" in d.reason
    d = decide(spike(120, attempt=2), rec(done=2), RUN.__class__(1, "r", "running", 2, 2))
    assert isinstance(d, policy.Stop) and d.status == "failed"
    assert "rollback budget of 2 spent" in d.reason


def test_nan_is_rolled_back_like_a_spike() -> None:
    d = decide(spike(120, kind="nonfinite"), rec())
    assert isinstance(d, policy.Restart) and d.checkpoint == "/ck/step_100"
    assert d.incident is not None and d.incident.kind == "nonfinite"


def test_no_checkpoint_before_the_spike_stops_the_run() -> None:
    d = decide(spike(55), rec())
    assert isinstance(d, policy.Stop) and "no complete checkpoint" in d.reason


def test_no_progress_across_restarts_stops_the_run() -> None:
    r = rec(done=0, high_step=300, high_at_restarts=(300, 300, 300),
            restarts_by_cause={"crash": 3})
    ok, why = policy.budget_left("crash", RUN, r, CFG)
    assert not ok and "no progress: 3 restarts" in why
    ok, _ = policy.budget_left("crash", RUN, rec(high_step=301,
                                                 high_at_restarts=(300, 300, 300)), CFG)
    assert ok


# --- the operator's rollback through the API --------------------------------------------------


def post(client: TestClient, body: dict[str, Any], headers: dict[str, str] | None = None,
         run: str = "r1") -> Any:
    return client.post(f"/api/v1/runs/{run}/rollback", json=body,
                       headers=OPERATOR if headers is None else headers)


def count_actions(db: Database) -> int:
    with db.read() as c:
        return count_rows(c, "actions")


def test_operator_rollback_queues_a_gang_restart_with_the_plan(
        client: TestClient, evaluator: Evaluator, db: Database, clock: FakeClock) -> None:
    a = run_with_checkpoints(client)
    r = post(client, {"step": 100, "skip": [[110, 129]], "lr_scale": 0.5,
                      "lr_scale_steps": 20, "lr_ramp_steps": 10, "reason": "bad shard"})
    assert r.status_code == 202, r.text
    action_id = r.json()["action_id"]
    act = client.get(f"/api/v1/actions/{action_id}", headers=OPERATOR).json()
    assert act["kind"] == "restart" and act["actor"] == "operator" and act["status"] == "queued"
    assert act["reason"] == "bad shard" and act["cause"] == "operator"
    assert act["plan"]["checkpoint"] == "/ck/step_100" and act["plan"]["skip"] == [[110, 129]]
    assert act["plan"]["lr"] == {"scale": 0.5, "steps": 20, "ramp_steps": 10}
    (cmd,) = ingest(client, a, 1, [])["commands"]
    assert cmd["kind"] == "restart" and cmd["plan"] == act["plan"]
    assert act["rollback_to_step"] == 100
    # The branch after step 100 is abandoned: never offered as the newest checkpoint again.
    cps = {c["step"]: c["abandoned"] for c in
           client.get("/api/v1/runs/r1/checkpoints", headers=OPERATOR).json()["checkpoints"]}
    assert cps == {50: False, 100: False, 125: True}
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).json()["checkpoint"]["step"] == 100
    # The old workers save once more before the restart reaches them: that late checkpoint
    # is on the abandoned branch too, and never becomes the newest.
    ingest(client, a, 10, [{"type": "checkpoint", "step": 150, "path": "/ck/step_150",
                            "bytes": 5, "t": 300.0, "lineage": "a0", "attempt": 0}])
    evaluator.tick()
    cps = {c["step"]: c["abandoned"] for c in
           client.get("/api/v1/runs/r1/checkpoints", headers=OPERATOR).json()["checkpoints"]}
    assert cps == {50: False, 100: False, 125: True, 150: True}
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).json()["checkpoint"]["step"] == 100
    # Progress: delivered, restarted, resumed at the first step of the new attempt.
    ack = {"type": "command_result", "t": 1.0, "command_id": cmd["id"]}
    ingest(client, a, 2, [{**ack, "status": "delivered"}, {**ack, "status": "done"}])
    ingest(client, a, 3, [step(0, 100, attempt=1, batch_index=130)], attempt=1)
    evaluator.tick()
    act = client.get(f"/api/v1/actions/{action_id}", headers=OPERATOR).json()
    assert act["status"] == "resumed" and act["resumed_step"] == 100
    assert set(act["progress"]) >= {"queued", "delivered", "restarted", "resumed"}


@pytest.mark.parametrize("body, headers, code, msg", [
    ({"step": 100}, {}, 401, ""),
    ({"step": 100}, AGENT, 403, ""),
    ({"step": 7}, None, 404, "has no checkpoint at step 7"),
    ({"checkpoint": 999}, None, 404, "no checkpoint 999"),
    ({"step": 100, "checkpoint": 1}, None, 422, "exactly one"),
    ({}, None, 422, "exactly one"),
    ({"step": 100, "skip": [[9, 3]]}, None, 422, "0 <= from <= to"),
    ({"step": 100, "lr_scale": 0.5}, None, 422, "lr_scale_steps"),
    ({"step": 100, "lr_scale": -1, "lr_scale_steps": 3}, None, 422, "greater than 0"),
    ({"step": 100, "bogus": 1}, None, 422, "bogus"),
])
def test_bad_rollbacks_are_refused_and_store_nothing(
        client: TestClient, db: Database, body: dict[str, Any], headers: Any, code: int,
        msg: str) -> None:
    run_with_checkpoints(client)
    before = count_actions(db)
    r = post(client, body, headers)
    assert r.status_code == code, r.text
    assert msg in r.text
    assert count_actions(db) == before


def test_rollback_to_an_abandoned_checkpoint_or_an_unknown_run_is_refused(
        client: TestClient, db: Database) -> None:
    run_with_checkpoints(client)
    assert post(client, {"step": 50}).status_code == 202
    before = count_actions(db)
    r = post(client, {"step": 125})
    assert r.status_code == 422 and "abandoned" in r.text
    assert post(client, {"step": 50}, run="nope").status_code == 404
    assert client.get("/api/v1/actions/9999", headers=OPERATOR).status_code == 404
    assert count_actions(db) == before


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_rollback_body_sent_as_curl_sends_it_is_read_as_json(
        client: TestClient, content_type: str) -> None:
    """`curl -d '{...}'` labels the body as a form; the API reads it as the JSON it is."""
    run_with_checkpoints(client)
    r = client.post("/api/v1/runs/r1/rollback", content=b'{"step": 100, "reason": "by curl"}',
                    headers={**OPERATOR, "content-type": content_type})
    assert r.status_code == 202, r.text
    act = client.get(f"/api/v1/actions/{r.json()['action_id']}", headers=OPERATOR).json()
    assert act["reason"] == "by curl"


def test_a_recurring_spike_is_sized_on_the_current_attempts_batches(
        client: TestClient, db: Database) -> None:
    """After a rollback that skipped batches, attempt 1 trains step s on another batch than
    attempt 0 did.  When the spike comes back, the steps the decision names (its start, where
    it was detected) are looked up in attempt 1 only: rank 0's row of the detection step may
    not be stored yet (rank 1's showed the spike), and attempt 0's batch for that step would
    shrink the widened skip to nothing (a CI run skipped batches 241-242 instead of 241-362)."""
    from tests.supervisor.sup_helpers import register
    from trainwarden.supervisor.control import actions
    from trainwarden.supervisor.store import registry
    from trainwarden.supervisor.store.tables import runs

    a = register(client)["agent_id"]
    seq = 0
    for s in (150, 190, 240):  # attempt 0: batch = step
        ingest(client, a, seq, [step(r, s, batch_index=s) for r in (0, 1)])
        seq += 1
    with db.write() as conn:
        run_id = registry.get_run_by_name(conn, name="r1")["id"]
        conn.execute(runs.update().where(runs.c.id == run_id).values(attempt=1))
    # attempt 1 resumed at 150 skipping batches 190-250: step 190 trains batch 251
    ingest(client, a, seq, [step(r, 190, attempt=1, batch_index=251) for r in (0, 1)],
           attempt=1)
    ingest(client, a, seq + 1, [step(1, 240, attempt=1, batch_index=301)], attempt=1)
    with db.read() as conn:
        run = registry.get_run_by_name(conn, name="r1")
        facts = actions.recovery(conn, run, [190, 240])
    assert facts.batch_index[190] == 251
    assert 240 not in facts.batch_index  # rank 0 has not reported it in attempt 1
    skip, _ = policy.rollback_plan(190, 240, 150, facts, DEFAULT, done=1)
    assert skip == ((241, 362),)  # 10 before batch 251 through 301 (= 251 + 50), doubled

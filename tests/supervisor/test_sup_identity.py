"""A run is itself: every run has a uuid issued at creation, a finished run is not reopened by
a new agent, and an agent whose reports carry another attempt than the run's is realigned
within seconds, or an incident says why."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    AGENT,
    FakeClock,
    crash,
    ingest,
    make_settings,
    register,
    step,
)
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database, make_database
from trainwarden.supervisor.store.models import metadata

CFG = policy.PolicyConfig()


def _get(client: TestClient, path: str = "") -> Any:
    from tests.supervisor.sup_helpers import OPERATOR

    r = client.get(f"/api/v1/runs/r1{path}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def _complete(client: TestClient, evaluator: Evaluator, agent_id: int, seq: int) -> None:
    ingest(client, agent_id, seq, [step(0, 0, world_size=1),
                                   {"type": "exit", "attempt": 0, "t": 1.0, "exit_code": 0,
                                    "signal": None, "outcome": "completed"}])
    evaluator.tick()
    assert _get(client)["status"] == "completed"


# ---- the run's uuid ------------------------------------------------------------------------


def test_registration_returns_the_runs_uuid_the_same_for_every_agent(client: TestClient
                                                                    ) -> None:
    first = register(client, node="n0")
    again = register(client, node="n0")
    other_node = register(client, node="n1")
    assert len(first["run_uuid"]) == 36
    assert again["run_uuid"] == first["run_uuid"]
    assert other_node["run_uuid"] == first["run_uuid"]


def test_a_fresh_database_gives_a_reused_name_another_uuid(
        client: TestClient, tmp_path: Any, clock: FakeClock) -> None:
    first = register(client, node="n0")
    db: Database = make_database(f"sqlite:///{tmp_path / 'fresh.db'}", pool_size=2)
    metadata.create_all(db.engine)
    try:
        app = create_app(make_settings(), db=db, clock=clock, upgrade_schema=False,
                         start_evaluator=False)
        with TestClient(app) as fresh:
            again = register(fresh, node="n0")
    finally:
        db.dispose()
    assert again["run_uuid"] != first["run_uuid"]


def test_registration_into_a_finished_run_is_refused_and_names_the_flag(
        client: TestClient, evaluator: Evaluator) -> None:
    a = register(client, node="n0")["agent_id"]
    _complete(client, evaluator, a, 0)
    r = client.post("/api/v1/agents/register", headers=AGENT,
                    json={"run": "r1", "node": "n9", "hostname": "h", "pid": 1,
                          "command": ["torchrun", "train.py"]})
    assert r.status_code == 409
    assert "already completed" in r.json()["detail"]
    assert "--run" in r.json()["detail"]
    # nothing changed: the run is still completed and has no new agent
    assert _get(client)["status"] == "completed"
    assert [x["node"] for x in _get(client)["agents"]] == ["n0"]


# ---- attempt mismatch ----------------------------------------------------------------------


def test_an_agent_reporting_another_attempt_is_realigned_within_seconds(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    a = register(client, node="n0")["agent_id"]  # the run is at attempt 0
    # Its workers run attempt 1 (an agent state left by an earlier run of this name).
    assert ingest(client, a, 0, [step(0, 5, attempt=1)], attempt=1)["commands"] == []
    evaluator.tick()
    clock.advance(2)
    evaluator.tick()
    assert ingest(client, a, 1, [], attempt=1)["commands"] == []  # not yet: 2 s
    clock.advance(4)
    evaluator.tick()
    cmds = ingest(client, a, 2, [], attempt=1)["commands"]
    assert len(cmds) == 1
    cmd = cmds[0]
    assert cmd["kind"] == "restart"
    assert cmd["attempt"] == 0
    assert cmd["plan"]["checkpoint"] is None  # each worker's own newest checkpoint
    assert "reports attempt 1 while run is at attempt 0" in cmd["reason"]
    events = [e["name"] for e in _get(client, "/events")["events"]]
    assert "attempt_realign" in events
    # The agent relaunches as attempt 0: its reports count, no incident.
    ingest(client, a, 3, [{"type": "command_result", "command_id": cmd["id"],
                           "status": "done", "detail": "relaunched as attempt 0"},
                          step(0, 0, attempt=0)], attempt=0)
    for seq in range(4, 18):  # past the realign timeout, the agent alive at attempt 0
        clock.advance(5)
        assert ingest(client, a, seq, [], attempt=0)["commands"] == []
        evaluator.tick()
    assert _get(client, "/incidents")["incidents"] == []
    assert _get(client)["step"] == 0


def test_an_agent_that_cannot_realign_gets_an_incident_that_says_why(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    a = register(client, node="n0")["agent_id"]
    ingest(client, a, 0, [step(0, 5, attempt=1)], attempt=1)
    evaluator.tick()
    clock.advance(6)
    evaluator.tick()  # the realign command is queued
    cmd = ingest(client, a, 1, [], attempt=1)["commands"][0]
    ingest(client, a, 2, [{"type": "command_result", "command_id": cmd["id"],
                           "status": "failed", "detail": "launch failed: no torchrun"}],
           attempt=1)
    evaluator.tick()
    incidents = _get(client, "/incidents")["incidents"]
    assert [i["kind"] for i in incidents] == ["attempt_mismatch"]
    cause = incidents[0]["cause"]
    assert "node n0 reports attempt 1 while run is at attempt 0" in cause
    assert "launch failed: no torchrun" in cause
    clock.advance(5)
    ingest(client, a, 3, [], attempt=1)
    evaluator.tick()
    assert len(_get(client, "/incidents")["incidents"]) == 1  # opened once
    ingest(client, a, 4, [step(0, 0, attempt=0)], attempt=0)  # relaunched by hand
    evaluator.tick()
    assert _get(client, "/incidents")["incidents"][0]["status"] == "resolved"


def test_an_agent_that_ignores_the_realign_gets_an_incident_in_time(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    a = register(client, node="n0")["agent_id"]
    for seq in range(16):  # 80 s of batches of attempt 1: the command is never acted on
        ingest(client, a, seq, [step(0, 5 + seq, attempt=1)], attempt=1)
        evaluator.tick()
        clock.advance(5)
    incidents = _get(client, "/incidents")["incidents"]
    assert [i["kind"] for i in incidents] == ["attempt_mismatch"]
    assert "has not picked up the command to relaunch as attempt 0" in incidents[0]["cause"]


def test_a_node_lagging_during_a_restart_is_not_a_mismatch(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    a0 = register(client, node="n0")["agent_id"]
    a1 = register(client, node="n1")["agent_id"]
    ingest(client, a0, 0, [step(0, 1)])
    ingest(client, a1, 0, [step(1, 1)])
    ingest(client, a0, 1, [crash()])
    evaluator.tick()  # restart to attempt 1 decided; both agents still report attempt 0
    for i in range(4):
        clock.advance(5)
        ingest(client, a1, 1 + i, [], attempt=0)
        evaluator.tick()
    assert "attempt_realign" not in [e["name"] for e in _get(client, "/events")["events"]]


def test_policy_on_attempt_mismatch() -> None:
    base = policy.MismatchFacts(agent_id=1, node="n0", agent_attempt=1, run_attempt=0,
                                mismatch_s=10.0)
    assert isinstance(policy.on_attempt_mismatch(base, CFG), policy.Realign)
    young = policy.MismatchFacts(**{**base.__dict__, "mismatch_s": 1.0})
    assert isinstance(policy.on_attempt_mismatch(young, CFG), policy.Note)
    restarting = policy.MismatchFacts(**{**base.__dict__, "restart_in_progress": True})
    assert isinstance(policy.on_attempt_mismatch(restarting, CFG), policy.Note)
    failed = policy.MismatchFacts(**{**base.__dict__, "realign": policy.RealignSent(
        status="failed", age_s=1.0, detail="launch failed: no torchrun")})
    d = policy.on_attempt_mismatch(failed, CFG)
    assert isinstance(d, policy.OpenIncident)
    assert "launch failed: no torchrun" in d.incident.cause
    waiting = policy.MismatchFacts(**{**base.__dict__, "realign": policy.RealignSent(
        status="delivered", age_s=10.0)})
    assert isinstance(policy.on_attempt_mismatch(waiting, CFG), policy.Note)

"""A run with no spare left is requeued in its scheduler (``fleet.requeue``): the policy's rule,
the Slurm command (a fake ``scontrol`` on PATH; the real one: tests/e2e/test_slurm_requeue.py),
and the fleet's round over the store and the evaluator: the waiting node is cordoned and
drained before the job is requeued, once, and the job's next allocation goes on as the same
run (a new attempt, the loss counted once)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import OPERATOR, FakeClock, ingest, register, step
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.fleet_sync import FleetConfig, FleetSync
from trainwarden.supervisor.enums import Verdict
from trainwarden.supervisor.fleet import FleetNode, FleetNodeState, FleetResult
from trainwarden.supervisor.fleet.slurm import SlurmFleet
from trainwarden.supervisor.store.db import Database

WAITING = {"n1": "lost"}


def test_the_rule_requeues_a_waiting_attempt_once_and_only_when_asked() -> None:
    d = policy.requeue_when_no_spare(enabled=True, attempt=1, waiting=WAITING, job="77",
                                     requeued_for=None)
    assert isinstance(d, policy.Requeue)
    assert (d.job, d.attempt) == ("77", 1)
    assert d.drain == (("n1", "trainwarden: lost; the run's job 77 is requeued without it"),)
    assert d.reason == ("no spare is free and the run may not shrink: job 77 is requeued "
                        "without n1 (lost)")
    # Once per waiting attempt; a later attempt that waits again is requeued again.
    again = policy.requeue_when_no_spare(enabled=True, attempt=1, waiting=WAITING, job="77",
                                         requeued_for=1)
    assert isinstance(again, policy.Note) and again.verdict == Verdict.ONGOING
    assert isinstance(policy.requeue_when_no_spare(enabled=True, attempt=3, waiting=WAITING,
                                                   job="77", requeued_for=1), policy.Requeue)
    # Off, outside a scheduler job, or nothing waited for: the run stands by as before.
    for kw in ({"enabled": False}, {"job": ""}, {"waiting": {}}):
        args: dict[str, Any] = {"enabled": True, "attempt": 1, "waiting": WAITING, "job": "77",
                                "requeued_for": None, **kw}
        n = policy.requeue_when_no_spare(**args)
        assert isinstance(n, policy.Note), kw


def test_the_slurm_requeue_is_scontrol_requeue_of_the_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {calls}\n'
                                   'if [ "$2" = 13 ]; then echo "Invalid job id" >&2; exit 1; fi\n')
    (fake / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    ok = SlurmFleet().requeue("77")
    assert ok.ok and ok.command == "scontrol requeue 77", ok
    bad = SlurmFleet().requeue("13")
    assert not bad.ok and "Invalid job id" in bad.output and "exit 1" in bad.output
    assert calls.read_text().splitlines() == ["requeue 77", "requeue 13"]


class FakeFleet:
    name = "slurm"

    def __init__(self, nodes: list[str]) -> None:
        self.calls: list[tuple[str, ...]] = []
        self.drained: dict[str, str] = {}
        self.nodes = nodes

    def check(self) -> FleetResult:
        return FleetResult("check", True, "")

    def node_states(self) -> tuple[dict[str, FleetNode], FleetResult]:
        return ({n: FleetNode(n, FleetNodeState.DRAINED if n in self.drained
                              else FleetNodeState.AVAILABLE, self.drained.get(n, ""))
                 for n in self.nodes}, FleetResult("show", True, ""))

    def cordon(self, node: str, reason: str) -> FleetResult:
        self.calls.append(("drain", node))
        self.drained[node] = reason
        return FleetResult(f"drain {node}", True, "")

    def uncordon(self, node: str) -> FleetResult:
        self.calls.append(("resume", node))
        self.drained.pop(node, None)
        return FleetResult(f"resume {node}", True, "")

    def requeue(self, job: str) -> FleetResult:
        self.calls.append(("requeue", job))
        return FleetResult(f"scontrol requeue {job}", True, "")


def get(client: TestClient, path: str) -> Any:
    r = client.get(f"/api/v1{path}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def _waiting_run(client: TestClient, evaluator: Evaluator, clock: FakeClock) -> dict[str, int]:
    """A two-node run of job 77 whose member n1 went silent: no spare, it stands by."""
    ids = {n: register(client, node=n, scheduler_job="77")["agent_id"] for n in ("n0", "n1")}
    ingest(client, ids["n0"], 0, [step(0, 0), {"type": "checkpoint", "step": 1, "path": "/ck/1",
                                                 "bytes": 5, "t": 10.0, "lineage": "a0"}])
    ingest(client, ids["n1"], 0, [step(1, 0)])
    evaluator.tick()
    clock.advance(40)  # past the node-lost deadline
    ingest(client, ids["n0"], 1, [])
    evaluator.tick()
    (act,) = get(client, "/runs/r1/actions")["actions"]
    assert act["plan"]["membership"]["waiting"] == [1], act
    return ids


def test_a_waiting_run_is_requeued_once_without_its_lost_node_and_goes_on_as_the_same_run(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    _waiting_run(client, evaluator, clock)
    run = get(client, "/runs/r1")
    fleet = FakeFleet(["n0", "n1", "n2"])
    sync = FleetSync(db, fleet, FleetConfig(backend="slurm", requeue=True), clock=clock)
    sync.round()
    # The lost node is cordoned and drained before the job is requeued.
    assert fleet.calls == [("drain", "n1"), ("requeue", "77")]
    assert fleet.drained["n1"].startswith("trainwarden: lost")
    host = get(client, "/hosts/n1")
    assert host["state"] == "cordoned" and "requeued" in host["reason"], host
    (ev,) = [e for e in get(client, "/runs/r1/events")["events"] if e["name"] == "requeued"]
    assert ev["details"]["job"] == "77" and ev["details"]["ok"] is True
    assert ev["details"]["drained"] == ["n1"] and ev["details"]["attempt"] == run["attempt"]
    assert "job 77 is requeued without n1 (lost)" in ev["message"]
    # The run's condition says so: it waits for the job's new allocation.
    cond = get(client, "/runs/r1")["condition"]
    assert cond["state"] == "waiting" and "job 77 was requeued without n1" in cond["summary"], \
        cond
    # Once: later rounds neither requeue again nor lift the drain.
    sync.round()
    clock.advance(60)
    sync.round()
    assert fleet.calls == [("drain", "n1"), ("requeue", "77")]

    # The job's new allocation (n0 again, and n2) registers to the same run: the gang
    # restarts on it, from the newest checkpoint, counted against no budget.
    register(client, node="n0", scheduler_job="77")
    register(client, node="n2", scheduler_job="77")
    evaluator.tick()
    after = get(client, "/runs/r1")
    assert after["uuid"] == run["uuid"]
    assert after["attempt"] == run["attempt"] + 1
    assert after["restarts_by_cause"]["node_lost"] == 1
    new = max(get(client, "/runs/r1/actions")["actions"], key=lambda a: a["id"])
    assert new["cause"] == "replace" and new["plan"]["checkpoint"] == "/ck/1"
    assert new["plan"]["membership"]["members"] == {"n0": 0, "n2": 1}


def test_without_fleet_requeue_or_a_job_the_run_stands_by(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    _waiting_run(client, evaluator, clock)
    fleet = FakeFleet(["n0", "n1", "n2"])
    FleetSync(db, fleet, FleetConfig(backend="slurm"), clock=clock).round()
    assert fleet.calls == []
    assert [e for e in get(client, "/runs/r1/events")["events"] if e["name"] == "requeued"] == []


def test_fleet_requeue_needs_a_fleet() -> None:
    with pytest.raises(ValueError, match=r"fleet\.requeue needs a fleet backend"):
        FleetConfig(requeue=True)

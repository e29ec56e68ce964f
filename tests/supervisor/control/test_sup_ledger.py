"""The health ledger in the evaluator's tick (``control.ledger``), through ingest and the store
on SQLite and Postgres: a machine crash is evidence once however many ticks read it, the
second within the window cordons its node (an audited host action naming the evidence), a
user-code crash never counts; a hang's silent culprit, a failed preflight and a new ECC error
count; a passed preflight ends a probation."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import FakeClock, ingest, register, step
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.enums import Actor, EvidenceKind, HostActionKind, HostState
from trainwarden.supervisor.store import hosts, registry
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.rows import RunRow


def user_error(line: int) -> dict[str, Any]:
    """A KeyError raised at ``line`` of the training script (another line: another bug, so
    the run is not stopped for a repeated one)."""
    frame = {"file": "/home/u/train.py", "line": line, "function": "collate"}
    return {"exc_type": "KeyError", "message": "'label'", "frame": frame, "user_frame": frame,
            "traceback": "Traceback (most recent call last):\nKeyError: 'label'",
            "source": "stderr", "rank": 0, "host": "h"}


def killed(attempt: int, rank: int = 0) -> dict[str, Any]:
    """An exit whose worker was killed by SIGKILL, no traceback: the machine's class."""
    return {"type": "exit", "attempt": attempt, "t": 200.0, "exit_code": None, "signal": 9,
            "outcome": "crashed",
            "failed_ranks": [{"rank": rank, "local_rank": 0, "exit_code": None, "signal": 9,
                              "pid": 10, "message": "Signals.SIGKILL"}]}


def user_crash(attempt: int, rank: int = 0) -> dict[str, Any]:
    return {"type": "exit", "attempt": attempt, "t": 200.0, "exit_code": 1, "signal": None,
            "outcome": "crashed",
            "failed_ranks": [{"rank": rank, "local_rank": 0, "exit_code": 1, "signal": None,
                              "pid": 10, "message": "KeyError",
                              "root_cause": user_error(50 + attempt)}]}


def event(clock: FakeClock, name: str, details: dict[str, Any], attempt: int = 0,
          message: str = "") -> dict[str, Any]:
    return {"type": "event", "attempt": attempt, "rank": 0, "t": clock.now, "name": name,
            "message": message, "details": details}


class Node:
    """One agent of run r1, its batches numbered."""

    def __init__(self, client: TestClient, node: str) -> None:
        self.client, self.node = client, node
        self.id = register(client, node=node)["agent_id"]
        self.seq = 0

    def send(self, *items: dict[str, Any], attempt: int = 0) -> None:
        ingest(self.client, self.id, self.seq, list(items), attempt=attempt)
        self.seq += 1


def run_r1(db: Database) -> RunRow:
    with db.read() as c:
        r = registry.get_run_by_name(c, name="r1")
    assert r is not None
    return r


def state(db: Database, node: str) -> str:
    """The node's state (a node without a row is healthy)."""
    with db.read() as c:
        h = hosts.get_host(c, node=node)
    return HostState.HEALTHY if h is None else h["state"]


def evidence(db: Database, node: str) -> list[dict[str, Any]]:
    with db.read() as c:
        return [dict(e) for e in hosts.evidence(c, node=node)]


def test_machine_crashes_cordon_their_node_on_the_second_within_a_day(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    n1, n2 = Node(client, "n1"), Node(client, "n2")
    n1.send(step(0, 0), step(1, 0))
    n1.send(killed(0))
    evaluator.tick()
    (first,) = evidence(db, "n1")
    assert first["kind"] == EvidenceKind.INFRA_FAILURE and first["attempt"] == 0
    assert first["detail"]["what"] == "crash (killed by signal 9)"
    assert first["detail"]["run"] == "r1"
    for _ in range(3):  # read again on every tick, recorded once
        clock.advance(1)
        evaluator.tick()
    assert len(evidence(db, "n1")) == 1 and state(db, "n1") == HostState.HEALTHY

    # a bug of the training script on n2, twice: never evidence against n2
    clock.advance(600)
    n2.send(step(2, 1, attempt=1), user_crash(1, rank=2), attempt=1)
    evaluator.tick()
    clock.advance(600)
    n2.send(user_crash(2, rank=2), attempt=2)
    evaluator.tick()
    assert evidence(db, "n2") == [] and state(db, "n2") == HostState.HEALTHY

    # the second machine crash on n1 within 24 h: cordoned, audited with the evidence
    clock.advance(3600)
    attempt = run_r1(db)["attempt"]
    n1.send(killed(attempt), attempt=attempt)
    evaluator.tick()
    ev1 = evidence(db, "n1")
    assert len(ev1) == 2
    assert state(db, "n1") == HostState.CORDONED
    with db.read() as c:
        (act,) = hosts.host_actions(c, "n1")
        assert hosts.cordoned_nodes(c) == {"n1"}
    assert (act["kind"], act["actor"]) == (HostActionKind.CORDON, Actor.POLICY)
    assert act["evidence_ids"] == [e["id"] for e in ev1]
    assert act["reason"].startswith("cordon.infra_failures: 2 infrastructure failures within "
                                    "24 h: crash (killed by signal 9) at ")
    assert act["run_id"] is not None
    # the cordon restarted nothing of its own: one restart per crash
    clock.advance(1)
    evaluator.tick()
    with db.read() as c:
        assert len(hosts.host_actions(c, "n1")) == 1


def test_two_crashes_further_apart_than_the_window_do_not_cordon(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    n1 = Node(client, "n1")
    n1.send(step(0, 0), killed(0))
    evaluator.tick()
    clock.advance(86400 + 60)
    n1.send(killed(1), attempt=1)
    evaluator.tick()
    assert len(evidence(db, "n1")) == 2 and state(db, "n1") == HostState.HEALTHY


def test_a_hang_counts_once_its_culprit_is_named(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    n1, n2 = Node(client, "n1"), Node(client, "n2")
    n1.send(step(0, 0), step(1, 0))
    n2.send(step(2, 0), step(3, 0))
    with db.write() as c:
        inc = rec.open_incident(c, run_id=run_r1(db)["id"], kind="hang", cause="no progress",
                                attempt=0, opened_at=clock.now, updated_at=clock.now)
    evaluator.tick()
    assert evidence(db, "n2") == []
    clock.advance(5)
    culprit = {"ranks": [3], "reason": "rank 3 did not answer the stack dump",
               "per_rank": {"2": {"state": "collective"}, "3": {"state": "no_dump"}}}
    with db.write() as c:
        rec.update_incident(c, incident_id=inc, details={"culprit": culprit}, node="n2",
                            rank=3, updated_at=clock.now)
    evaluator.tick()
    (e,) = evidence(db, "n2")
    assert e["kind"] == EvidenceKind.HANG_CULPRIT and e["detail"]["ranks"] == [3]
    assert e["source"] == f"incident:{inc}" and evidence(db, "n1") == []


def test_a_failed_preflight_cordons_and_probation_ends_with_a_passed_one(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    n1 = Node(client, "n1")
    n1.send(event(clock, "preflight", {"passed": True, "failed": None, "checks": []}))
    evaluator.tick()
    assert state(db, "n1") == HostState.HEALTHY  # a pass outside probation changes nothing
    clock.advance(10)
    n1.send(event(clock, "preflight", {"passed": False, "failed": "nccl_allreduce",
                                       "checks": [{"name": "nccl_allreduce", "ok": False}]}))
    evaluator.tick()
    assert state(db, "n1") == HostState.CORDONED
    with db.read() as c:
        (act,) = hosts.host_actions(c, "n1")
    assert act["reason"].startswith("cordon.on_failed_preflight: failed a preflight "
                                    "(nccl_allreduce) at ")

    # an operator uncordons: probation, until a preflight passes (never silently)
    clock.advance(60)
    with db.write() as c:
        hosts.uncordon(c, node="n1", reason="cable reseated", actor="operator", now=clock.now)
    clock.advance(1)
    evaluator.tick()
    assert state(db, "n1") == HostState.PROBATION  # the old failure does not cordon it again
    clock.advance(10)
    n1.send(event(clock, "preflight", {"passed": True, "failed": None, "checks": []},
                  attempt=1), attempt=1)
    evaluator.tick()
    assert state(db, "n1") == HostState.HEALTHY
    with db.read() as c:
        passed = hosts.host_actions(c, "n1")[0]
    assert (passed["kind"], passed["actor"]) == (HostActionKind.PROBATION_PASSED, Actor.POLICY)
    kinds = [e["kind"] for e in evidence(db, "n1")]
    assert kinds == [EvidenceKind.PREFLIGHT_PASSED, EvidenceKind.PREFLIGHT_FAILED,
                     EvidenceKind.PREFLIGHT_PASSED]
    assert passed["evidence_ids"] == [evidence(db, "n1")[-1]["id"]]


def test_a_new_uncorrected_ecc_error_cordons(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    n1 = Node(client, "n1")

    def beat(ecc: int) -> dict[str, Any]:
        return {"type": "heartbeat", "t": clock.now, "state": "running",
                "gpus": {"available": True, "devices": [
                    {"index": 0, "ecc_uncorrected": 0}, {"index": 1, "ecc_uncorrected": ecc}]}}

    n1.send(beat(0))
    evaluator.tick()
    assert evidence(db, "n1") == [] and state(db, "n1") == HostState.HEALTHY
    clock.advance(10)
    n1.send(beat(1))
    evaluator.tick()
    (e,) = evidence(db, "n1")
    assert e["kind"] == EvidenceKind.ECC and e["detail"]["gpu"] == "1"
    assert state(db, "n1") == HostState.CORDONED
    clock.advance(10)
    evaluator.tick()
    assert len(evidence(db, "n1")) == 1  # the same count read again is nothing new


def test_an_xid_error_an_agent_reports_cordons(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    n1 = Node(client, "n1")
    n1.send({"type": "heartbeat", "t": clock.now, "state": "running",
             "gpus": {"available": True, "devices": [
                 {"index": 0, "ecc_uncorrected": 0, "xid_errors": 1, "xid_last": 79}]}})
    evaluator.tick()
    (e,) = evidence(db, "n1")
    assert e["kind"] == EvidenceKind.XID and e["detail"]["xid_last"] == 79
    assert state(db, "n1") == HostState.CORDONED


def test_a_disk_io_error_is_recorded_without_cordoning_by_default(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database) -> None:
    n1 = Node(client, "n1")
    n1.send(event(clock, "checkpoint_failed", {"path": "/ck/step_10"},
                  message="OSError: [Errno 5] Input/output error: '/ck/step_10'"),
            event(clock, "checkpoint_failed", {"path": "/ck/step_20"},
                  message="ValueError: cannot pickle"))
    evaluator.tick()
    (e,) = evidence(db, "n1")
    assert e["kind"] == EvidenceKind.DISK_ERROR and e["detail"]["path"] == "/ck/step_10"
    assert state(db, "n1") == HostState.HEALTHY


def test_a_failure_of_the_ledger_leaves_the_tick_whole_and_is_read_again(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, db: Database,
        monkeypatch: pytest.MonkeyPatch) -> None:
    n1 = Node(client, "n1")
    n1.send(step(0, 0), killed(0))
    real = hosts.record_evidence_once

    def broken(*a: Any, **kw: Any) -> int | None:
        raise RuntimeError("the store refused it")

    monkeypatch.setattr(hosts, "record_evidence_once", broken)
    evaluator.tick()
    assert run_r1(db)["attempt"] == 1  # the crash was handled: a restart
    assert evidence(db, "n1") == []
    monkeypatch.setattr(hosts, "record_evidence_once", real)
    clock.advance(1)
    evaluator.tick()  # read again from where the failed tick started
    assert [e["kind"] for e in evidence(db, "n1")] == [EvidenceKind.INFRA_FAILURE]

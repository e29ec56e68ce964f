"""Detection through the store: evaluator ticks turn measurements into one incident per episode
and the policy's response (gang restart with stack collection, incident only, event)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    OPERATOR,
    FakeClock,
    as_agent,
    crash,
    ingest,
    make_settings,
    register,
    step,
)
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.observer import Observer
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database


@pytest.fixture
def client(db: Database, clock: FakeClock) -> Iterator[TestClient]:
    settings = make_settings(hang_floor_s=5.0, hang_startup_s=60.0, hang_warmup_s=20.0,
                             node_lost_s=10.0, restart_budget=5)
    app = create_app(settings, db=db, clock=clock, upgrade_schema=False,
                     start_evaluator=False)
    with TestClient(app) as c:
        yield c


@pytest.fixture
def evaluator(client: TestClient) -> Evaluator:
    ev: Evaluator = client.app.state.evaluator  # type: ignore[attr-defined]
    return ev


def get(client: TestClient, path: str) -> Any:
    r = client.get(f"/api/v1/runs/r1{path}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


class Run:
    """One node, two ranks, training in step with the fake clock."""

    def __init__(self, client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
        self.client, self.clock, self.ev = client, clock, evaluator
        self.agent = register(client, node="n0")["agent_id"]
        self.seq = 0
        self.step = 0
        self.disk: dict[str, int] = {}

    def send(self, items: list[dict[str, Any]], attempt: int = 0) -> dict[str, Any]:
        # Like the real agent: every batch carries a heartbeat.
        beat = {"type": "heartbeat", "t": self.clock.now, "attempt": attempt, "state": "running",
                **self.disk}
        r = ingest(self.client, self.agent, self.seq, [*items, beat], attempt=attempt)
        self.seq += 1
        return r

    def train(self, n: int, *, dt: float = 0.5, loss: Any = None, compute: Any = None,
              attempt: int = 0) -> None:
        for _ in range(n):
            self.clock.advance(dt)
            items = []
            for rank in (0, 1):
                lv = loss(self.step) if loss else 1.0 / (1 + 0.01 * self.step)
                cs = compute(self.step, rank) if compute else 0.2
                items.append(step(rank, self.step, attempt=attempt, t=self.clock.now,
                                  loss=lv, compute_s=cs, data_s=0.01, world_size=2))
            self.send(items, attempt=attempt)
            self.step += 1
            self.ev.tick()


def test_clean_run_opens_no_incident(client: TestClient, clock: FakeClock,
                                     evaluator: Evaluator) -> None:
    import random

    rng = random.Random(3)
    run = Run(client, clock, evaluator)
    run.train(200, dt=0.5, loss=lambda s: 2.0 * math.exp(-s / 80) + 0.1 + rng.gauss(0, 0.02),
              compute=lambda s, r: 0.2 * (1 + rng.uniform(-0.2, 0.2)))
    assert get(client, "/incidents")["incidents"] == []
    assert get(client, "")["status"] == "running"


def test_hang_restarts_with_stack_collection_and_attaches_the_stacks(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = Run(client, clock, evaluator)
    run.train(30, dt=0.5)
    for _ in range(4):  # the agent keeps delivering heartbeats; no step arrives
        clock.advance(1.0)
        run.send([])
        evaluator.tick()
    assert get(client, "/incidents")["incidents"] == []  # under the 5 s floor: not yet
    clock.advance(10.0)  # no batch either: we cannot tell a hang from a delivery gap...
    evaluator.tick()
    assert get(client, "/incidents")["incidents"] == []
    clock.advance(0.5)
    run.send([])  # ...until the agent's next batch says its workers made no progress
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["kind"] == "hang" and inc["step"] == 29 and inc["attempt"] == 0
    (act,) = get(client, "/actions")["actions"]
    assert act["kind"] == "restart" and act["incident_id"] == inc["id"]
    (cmd,) = run.send([])["commands"]
    assert cmd["kind"] == "restart" and cmd["collect_stacks"] is True
    # The agent dumps the stacks before it kills the workers.
    run.send([{"type": "event", "t": clock.now, "attempt": 0, "name": "stacks",
               "message": "python stacks of 2 worker(s)",
               "details": {"stacks": {"0": "File train.py, line 9 in all_reduce",
                                      "1": "File train.py, line 7 in forward"},
                           "command_id": cmd["id"]}}])
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["details"]["stacks"]["1"] == "File train.py, line 7 in forward"
    # The workers' exit for the hung attempt is an echo, not a second failure.
    run.send([crash(attempt=0, rank=0)])
    evaluator.tick()
    assert len(get(client, "/incidents")["incidents"]) == 1
    assert get(client, "")["attempt"] == 1


STACKS = Path(__file__).parents[1] / "detect" / "stacks"


def hang_with_stacks(client: TestClient, clock: FakeClock, evaluator: Evaluator,
                     stacks: dict[str, str]) -> dict[str, Any]:
    """Both ranks stop at step 29 (nobody behind); the agent sends ``stacks``."""
    run = Run(client, clock, evaluator)
    run.train(30, dt=0.5)
    clock.advance(6.0)
    run.send([])
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["kind"] == "hang" and inc["rank"] is None and inc["details"]["behind"] == {}
    (cmd,) = run.send([])["commands"]
    run.send([{"type": "event", "t": clock.now, "attempt": 0, "name": "stacks",
               "message": f"python stacks of {len(stacks)} worker(s)",
               "details": {"stacks": stacks, "command_id": cmd["id"]}}])
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    return inc  # type: ignore[no-any-return]


def test_a_hang_with_every_rank_at_the_same_step_names_the_rank_outside_the_collective(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    inc = hang_with_stacks(client, clock, evaluator, {
        "0": (STACKS / "ddp_hang_rank0.txt").read_text(),
        "1": (STACKS / "ddp_hang_rank1.txt").read_text()})
    assert (inc["rank"], inc["node"]) == (1, "n0")
    assert inc["details"]["culprit"]["ranks"] == [1]
    assert inc["details"]["culprit"]["per_rank"]["0"]["state"] == "collective"
    assert inc["cause"].startswith("hang: no step progress")
    assert "; rank 1 is not in a collective (before_step (worker/faults.py:122))" in inc["cause"]


def test_a_rank_that_does_not_answer_the_dump_is_named(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    inc = hang_with_stacks(client, clock, evaluator,
                           {"0": (STACKS / "ddp_hang_rank0.txt").read_text()})
    assert (inc["rank"], inc["node"]) == (1, "n0")
    assert "rank 1 did not answer the stack dump" in inc["cause"]


def test_a_hang_with_every_rank_in_a_collective_says_it_cannot_tell(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    inc = hang_with_stacks(client, clock, evaluator, {
        "0": (STACKS / "mismatch_all_reduce_rank0.txt").read_text(),
        "1": (STACKS / "mismatch_broadcast_rank1.txt").read_text()})
    assert inc["rank"] is None and inc["node"] is None
    assert "cannot tell: every rank waits in a collective in different places" in inc["cause"]


def test_checkpoint_save_in_progress_extends_the_deadline(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = Run(client, clock, evaluator)
    run.train(30, dt=0.5)
    run.send([{"type": "event", "t": clock.now, "attempt": 0, "rank": 0,
               "name": "checkpoint_started", "step": 30, "message": "saving step_30"}])
    for _ in range(15):  # a 30 s save; the agent keeps sending its heartbeats
        clock.advance(2.0)
        run.send([])
        evaluator.tick()
    assert get(client, "/incidents")["incidents"] == []
    for _ in range(70):  # ...but a save that never ends is a hang too (600 s allowance)
        clock.advance(10.0)
        run.send([])
        evaluator.tick()
    assert [i["kind"] for i in get(client, "/incidents")["incidents"]] == ["hang"]


def test_collective_timeout_event_is_the_incident_and_the_crash_that_follows_an_echo(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = Run(client, clock, evaluator)
    run.train(5)
    run.send([{"type": "event", "t": clock.now, "attempt": 0, "rank": 0, "step": 5,
               "name": "collective_timeout",
               "message": "RuntimeError: Timed out waiting 3000ms for recv operation",
               "details": {"collective": "all_reduce (gradient sync in backward)"}}])
    evaluator.tick()
    run.send([crash(attempt=0, rank=0)])
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["kind"] == "collective_timeout" and inc["rank"] == 0
    assert "all_reduce" in inc["cause"] and "Timed out" in inc["cause"]
    assert get(client, "")["attempt"] == 1


def test_lost_node_restarts_the_gang(client: TestClient, clock: FakeClock,
                                     evaluator: Evaluator) -> None:
    run = Run(client, clock, evaluator)
    other = register(client, node="n1")["agent_id"]
    ingest(client, other, 0, [])
    run.train(15, dt=1.0)  # n1 stays silent from here (deadline 10 s)
    incidents = get(client, "/incidents")["incidents"]
    assert [(i["kind"], i["node"]) for i in incidents] == [("node_lost", "n1")]
    assert get(client, "")["status"] == "restarting"


def test_straggler_is_named_and_resolved_when_it_recovers(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = Run(client, clock, evaluator)
    run.train(40)
    run.train(40, compute=lambda s, r: 0.3 if r == 1 else 0.2)  # rank 1 is 1.5x slower
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["kind"] == "straggler" and inc["rank"] == 1 and inc["node"] == "n0"
    assert inc["status"] == "open" and 40 <= inc["step"] <= 45
    assert get(client, "")["status"] == "running"  # an incident, not a restart
    run.train(100)
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["status"] == "resolved"


def test_a_cold_start_is_not_a_straggler(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """An attempt's first steps run cold (a node that just joined more so): a rank slow for
    its first ``straggler.warmup_steps`` steps and normal after is never flagged."""
    run = Run(client, clock, evaluator)
    run.train(10, compute=lambda s, r: 0.6 if r == 1 else 0.2)  # rank 1 cold, 3x slower
    run.train(60)
    assert get(client, "/incidents")["incidents"] == []


def test_loss_spike_that_stays_is_one_incident_with_its_start_step(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = Run(client, clock, evaluator)
    run.train(150, loss=lambda s: 1.0 if s < 100 else 40.0)
    # It is not called before it has failed to come back within the recovery window...
    assert get(client, "/incidents")["incidents"] == []
    run.train(10, loss=lambda s: 40.0)
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["kind"] == "loss_spike" and inc["step"] == 100 and inc["status"] == "open"
    # ...and then named where it started and where it was seen not to come back.
    assert inc["details"]["detected_at_step"] == 150


def test_transient_spike_is_an_event_and_nan_an_incident_at_once(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = Run(client, clock, evaluator)
    run.train(80, loss=lambda s: 30.0 if 60 <= s < 64 else 1.0)
    assert get(client, "/incidents")["incidents"] == []
    events = [e for e in get(client, "/events")["events"] if e["name"] ==
              "loss_spike_transient"]
    assert len(events) == 1 and events[0]["step"] == 60
    run.train(1, loss=lambda s: float("nan"))
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["kind"] == "nonfinite" and inc["step"] == 80


def test_disk_filling_is_one_event_per_episode(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = Run(client, clock, evaluator)
    run.disk = {"disk_free_bytes": 50, "disk_total_bytes": 100}
    run.train(5)
    run.disk = {"disk_free_bytes": 5, "disk_total_bytes": 100}  # 5% free
    run.train(10)
    run.disk = {"disk_free_bytes": 30, "disk_total_bytes": 100}  # retention freed it
    run.train(3)
    run.disk = {"disk_free_bytes": 8, "disk_total_bytes": 100}  # filling again
    run.train(3)
    names = [(e["name"], e["details"]["node"], e["details"]["free_ratio"])
             for e in get(client, "/events")["events"]
             if e["name"].startswith("disk_")]
    assert sorted(names) == sorted([("disk_low", "n0", 0.05), ("disk_recovered", "n0", 0.3),
                                    ("disk_low", "n0", 0.08)])
    assert get(client, "/incidents")["incidents"] == []  # an alert, not a restart


def test_a_spike_delivered_in_one_burst_is_placed_at_its_first_step(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """A fast run: a second of steps arrives in one batch.  The spike starts at step 100 and
    150 steps of it come at once; the window still reaches back before it."""
    run = Run(client, clock, evaluator)
    run.train(100, loss=lambda s: 1.0 + 0.01 * (s % 3))
    clock.advance(1.0)
    for lo in (100, 175):  # two batches (the test server's body limit), then one tick
        run.send([step(rank, s, t=clock.now, loss=40.0, compute_s=0.2, data_s=0.01,
                       world_size=2) for s in range(lo, lo + 75) for rank in (0, 1)])
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["kind"] == "loss_spike" and inc["step"] == 100, inc


def test_a_run_that_ends_leaves_no_state_in_the_evaluator(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """A supervisor runs for months: what it keeps of a run between ticks (the incremental
    straggler window, the loss window's position) goes once the run is no longer active."""
    run = Run(client, clock, evaluator)
    run.train(30)
    assert set(evaluator._runs) == {1}
    observer = evaluator.observer
    assert isinstance(observer, Observer)  # (in the test's thread)
    assert set(observer._runs) == {1}
    assert observer._runs[1].loss_seen == (0, 29)
    run.send([{"type": "exit", "attempt": 0, "exit_code": 0, "outcome": "completed",
               "failed_ranks": []}])
    evaluator.tick()  # the exit completes the run
    evaluator.tick()  # the next observation no longer sees it
    assert get(client, "")["status"] == "completed"
    assert evaluator._runs == {}
    assert observer._runs == {}


@pytest.mark.parametrize("seed", range(8))
def test_the_hang_judgment_reads_few_ranks_and_judges_as_on_every_rank(
        client: TestClient, clock: FakeClock, evaluator: Evaluator, db: Database,
        seed: int) -> None:
    """The hang judgment of a tick reads only the lagging ranks (a big run has thousands);
    its findings are those of the same judgment on every rank's row."""
    import random

    from trainwarden.agent.core.hang import detect_hang
    from trainwarden.supervisor.control.detection import (
        attempt_started_at,
        hang_findings,
        progress_window,
    )
    from trainwarden.supervisor.store import registry

    rng = random.Random(seed)
    world = 24
    last = {r: 59 - (rng.choice([1, 2, 5, 9, 20, 30]) if rng.random() < 0.3 else 0)
            for r in range(world)}
    last[rng.randrange(world)] = 20  # one rank silent for longer than the deadline
    agent = register(client, node="n0")["agent_id"]
    for seq, s in enumerate(range(60)):
        clock.advance(0.5)
        # the last rank reports a second after the others: the newest step's first rank
        # does not hold the newest report time
        items = [step(r, s, t=clock.now - (r < world - 1), world_size=world,
                      compute_s=0.2, data_s=0.01) for r in range(world) if s <= last[r]]
        ingest(client, agent, seq, items)
    cfg = evaluator.detection
    with db.read() as conn:
        run = registry.get_run_by_name(conn, name="r1")
        assert run is not None
        started = attempt_started_at(conn, run)
        assert started is not None
        verdicts = set()
        for wait in [x / 10 for x in range(0, 400, 3)] + [600.0]:
            now = clock.now + wait
            full = detect_hang(progress_window(
                conn, run, started_at=started, observing_since=0.0, cfg=cfg), now, cfg.hang)
            got = hang_findings(conn, run, now=now, observing_since=0.0, cfg=cfg,
                                        agents=[], started=started)
            assert got == full, f"wait {wait}"
            verdicts.update(f.kind for f in full)
    assert verdicts == {"hang", "rank_stalled"}


def test_an_overloaded_supervisor_holds_its_verdicts_and_restarts_nothing(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """Two healthy nodes; the supervisor falls 14 s behind (longer than the 10 s node-lost
    deadline): node n0's batches arrive 14 s after they were sent, n1's not yet.  Judged
    on receive times n1 is lost; the overload holds that back: no incident, no restart, an
    event says why.  Once it keeps up again a node that really goes silent is lost."""
    a0 = register(client, node="n0")["agent_id"]
    a1 = register(client, node="n1")["agent_id"]
    seq = {a0: 0, a1: 0}

    def send(agent: int, rank: int, s: int, *, sent: float) -> None:
        beat = {"type": "heartbeat", "t": sent, "attempt": 0, "state": "running"}
        body = {"agent_id": agent, "seq": seq[agent], "sent_at": sent, "attempt": 0,
                "items": [step(rank, s, t=sent, world_size=2, compute_s=0.2), beat]}
        seq[agent] += 1
        r = client.post("/api/v1/ingest", content=json.dumps(body),
                        headers={**as_agent(client, agent), "content-type": "application/json"})
        assert r.status_code == 200, r.text

    s = 0
    for _ in range(30):  # healthy, one step a second, delivered at once
        clock.advance(1.0)
        send(a0, 0, s, sent=clock.now)
        send(a1, 1, s, sent=clock.now)
        s += 1
        evaluator.tick()
    behind_from = clock.now
    for _ in range(14):  # 14 s behind: n0's batches come late, n1's are still queued
        clock.advance(1.0)
        send(a0, 0, s, sent=clock.now - 14.0)
        evaluator.tick()
    assert evaluator.overload is not None
    assert get(client, "/incidents")["incidents"] == []
    assert get(client, "/actions")["actions"] == []
    events = get(client, "/events")["events"]
    assert [e["name"] for e in events if e["name"].startswith("supervisor_")] == \
        ["supervisor_overloaded"], events
    for k in range(14):  # the backlog drains: n1's queued batches arrive
        send(a1, 1, s - 14 + k, sent=behind_from + k)
    s += 1
    for _ in range(12):  # keeping up again, then n1 goes silent for good
        clock.advance(1.0)
        send(a0, 0, s, sent=clock.now)
        s += 1
        evaluator.tick()
    assert evaluator.overload is None
    names = [e["name"] for e in get(client, "/events")["events"]]
    assert "supervisor_overload_ended" in names, names
    assert get(client, "/incidents")["incidents"] == []  # n1 silent only 12 s: deadline 10 s
    for _ in range(15):  # counted from the recovery: past the deadline now
        clock.advance(1.0)
        send(a0, 0, s, sent=clock.now)
        s += 1
        evaluator.tick()
    kinds = [i["kind"] for i in get(client, "/incidents")["incidents"]]
    assert kinds == ["node_lost"], kinds

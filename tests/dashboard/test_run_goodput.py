"""The live ETTR of a run on a scripted history whose every part is known:
the evaluator's incremental accounting, on ``GET /api/v1/runs/{run}`` and ``/metrics``.

The history (seconds after the run's registration at T0; 4 ranks on 2 nodes, rank 3 slow):
attempt 0 reports steps 0..29, one every 2 s, each step ending at 5 + 2 s and lasting 0.7 s
(the slow rank's ``step_s``), with checkpoints after steps 10 and 20 (``save_s`` 1.5); rank 3
crashes at 64, the evaluator sees the exit at 66 and decides a restart; attempt 1 resumes at
step 20 and reports steps 20..39 (ending at 40 + 2 s), with checkpoints after 20 and 30; read
at 120."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import event

from tests.dashboard.apps import T0, FakeClock
from tests.dashboard.synth import OPERATOR, SynthRun
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store import goodput as goodput_store
from trainwarden.supervisor.store import registry
from trainwarden.supervisor.store.db import Database

STEP_S = 0.7  # the slow rank's step_s: the gang's step time
DATA_S = 0.02  # the median rank's data wait
STRAGGLER_S = (0.3 + 0.35) - (0.02 + 0.2)  # slowest pre-collective time - the median's
GAP_S = 2.0 - STEP_S  # between two steps
A0_STEPS, A1_STEPS = range(30), range(20, 40)
END = 120.0

EXPECTED = {
    "startup": 5 - STEP_S,  # registration -> the first step's start
    "lost_progress": (64 - 63)  # the step in flight at the crash (last step ended at 63)
    + 10 * STEP_S,  # steps 20..29 of attempt 0, redone by attempt 1
    "detection": 66 - 64,  # the exit at 64, seen by the evaluator at 66
    "restart": (40 + 2 * 20 - STEP_S) - 66,  # decided at 66 -> attempt 1's first step starts
    "checkpoint": 4 * GAP_S,  # each save (1.5 s) stalls the whole gap after its step
    "data_wait": 40 * DATA_S,  # 40 steps on the final lineage: 0..19 and 20..39
    "straggler": 40 * STRAGGLER_S,
    "capacity": 0.0,  # every step on the declared world
    "requeue": 0.0,  # no scheduler job was requeued
    "other": (29 + 19 - 4) * GAP_S + (END - (40 + 2 * 39)),  # the other gaps, the open tail
    "idle": 0.0,  # an agent ran all along
}
PRODUCTIVE = 40 * (STEP_S - DATA_S - STRAGGLER_S)


def script(client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = SynthRun(client, "alpha").register()
    run.train(A0_STEPS, t0=T0 + 5, dt=2.0, slow_rank=3, checkpoint_every=10, clock=clock)
    run.crash(node=1, rank=3, t=T0 + 64)
    clock.now = T0 + 66
    evaluator.tick()  # the exit: an incident and a restart to attempt 1
    clock.now = T0 + 70
    evaluator.tick()
    run.train(A1_STEPS, t0=T0 + 40, dt=2.0, attempt=1, slow_rank=3, checkpoint_every=10,
              clock=clock)
    clock.now = T0 + END
    evaluator.tick()


def test_goodput_parts_of_a_scripted_run(client: TestClient, clock: FakeClock,
                                         evaluator: Evaluator) -> None:
    script(client, clock, evaluator)
    r = client.get("/api/v1/runs/alpha", headers=OPERATOR)
    assert r.status_code == 200
    g = r.json()["goodput"]
    assert g["wall_s"] == pytest.approx(END)
    assert g["productive_s"] == pytest.approx(PRODUCTIVE)
    assert g["ettr"] == pytest.approx(PRODUCTIVE / END)
    for cause, secs in EXPECTED.items():
        assert g["badput_s"][cause] == pytest.approx(secs, abs=1e-4), cause
    assert g["badput_s"]["idle"] == 0.0  # an agent ran all along
    assert g["not_measured"] == {}
    assert sum(g["badput_s"].values()) + g["productive_s"] == pytest.approx(g["wall_s"])
    assert g["steps_final"] == 40
    assert g["steps_lost"] == 10


def test_goodput_on_metrics(client: TestClient, clock: FakeClock,
                            evaluator: Evaluator) -> None:
    script(client, clock, evaluator)
    text = client.get("/metrics", headers=OPERATOR).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    ratio = [s for s in fams["trainwarden_run_goodput_ratio"].samples
             if s.labels["run"] == "alpha"]
    assert [s.value for s in ratio] == [pytest.approx(PRODUCTIVE / END)]
    badput = {s.labels["cause"]: s.value for s in fams["trainwarden_run_badput_seconds"].samples
              if s.labels["run"] == "alpha"}
    assert badput == {k: pytest.approx(v, abs=1e-4) for k, v in EXPECTED.items()}
    # the ETTR's two sides, for a windowed ETTR in PromQL (the low-goodput alert)
    for fam, want in (("trainwarden_run_productive_seconds", PRODUCTIVE),
                      ("trainwarden_run_wall_seconds", END)):
        got = [s.value for s in fams[fam].samples if s.labels["run"] == "alpha"]
        assert got == [pytest.approx(want, abs=1e-4)], fam


def test_goodput_is_incremental(client: TestClient, clock: FakeClock,
                                evaluator: Evaluator) -> None:
    """A tick reads only the rows after the cursors: a second tick with nothing new feeds
    nothing (the step cursor stays) and the parts only grow by the open time."""
    script(client, clock, evaluator)
    run_id = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["id"]
    live = evaluator.goodput_feed.live(run_id)
    assert live is not None
    cursor = live.step_id
    before = evaluator.goodput(run_id)
    clock.now = T0 + END + 10
    evaluator.tick()
    after = evaluator.goodput(run_id)
    assert evaluator.goodput_feed.live(run_id) is live
    assert live.step_id == cursor
    assert before is not None and after is not None
    assert after["wall_s"] == pytest.approx(before["wall_s"] + 10)
    assert after["productive_s"] == pytest.approx(before["productive_s"])


def test_the_step_read_walks_the_primary_key_from_its_cursor(db: Database) -> None:
    """Not every row of the run through the (run, attempt, step) index and a sort: SQLite
    picks that plan for ``run_id = ? AND id > ? ORDER BY id`` when it has no statistics."""
    seen: list[tuple[str, Any]] = []

    def capture(conn: Any, cursor: Any, statement: str, params: Any, *_: Any) -> None:
        seen.append((statement, params))

    with db.read() as conn:
        event.listen(db.engine, "before_cursor_execute", capture)
        try:
            goodput_store.rank_step_groups_after(conn, run_id=1, after_id=5, limit=10)
        finally:
            event.remove(db.engine, "before_cursor_execute", capture)
        (statement, params), = seen
        plan = " ".join(str(r[-1]) for r in
                        conn.exec_driver_sql("EXPLAIN QUERY PLAN " + statement, params))
    assert "PRIMARY KEY" in plan and "TEMP B-TREE" not in plan, plan


def test_goodput_series_and_window(client: TestClient, clock: FakeClock,
                                   evaluator: Evaluator) -> None:
    """``GET /runs/{run}/goodput``: a cumulative point once a minute (the first tick's, then
    one a minute or more later), and the ETTR of the last ``window_s`` from the newest point
    at least that old."""
    script(client, clock, evaluator)  # ticks at 66, 70 and 120: one point, at 66
    clock.now = T0 + 200
    evaluator.tick()  # a second point, at 200
    r = client.get("/api/v1/runs/alpha/goodput", params={"window_s": 100}, headers=OPERATOR)
    assert r.status_code == 200
    body = r.json()
    assert [p["end"] - T0 for p in body["points"]] == [66.0, 200.0]
    first, cur, win = body["points"][0], body["current"], body["window"]
    assert (win["start"] - T0, win["end"] - T0) == (66.0, 200.0)
    assert win["wall_s"] == pytest.approx(134.0)
    assert win["productive_s"] == pytest.approx(cur["productive_s"] - first["productive_s"])
    assert win["ettr"] == pytest.approx(win["productive_s"] / 134.0)
    assert cur == client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["goodput"]
    assert sum(v for v in win["badput_s"].values() if v is not None) + win["productive_s"] \
        == pytest.approx(134.0)


def test_goodput_series_refuses_bad_input(client: TestClient) -> None:
    SynthRun(client, "alpha").register()
    r = client.get("/api/v1/runs/alpha/goodput", params={"window_s": 0}, headers=OPERATOR)
    assert r.status_code == 422
    assert client.get("/api/v1/runs/nope/goodput", headers=OPERATOR).status_code == 404
    body = client.get("/api/v1/runs/alpha/goodput", headers=OPERATOR).json()
    assert body["current"] is None and body["points"] == []  # not accounted yet


def test_goodput_of_a_run_that_ended_stops_counting(client: TestClient, clock: FakeClock,
                                                    evaluator: Evaluator,
                                                    db: Database) -> None:
    """The wall time ends when the run does; the breakdown stays readable after the
    evaluator drops the run's state."""
    script(client, clock, evaluator)
    run_id = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["id"]
    with db.write() as conn:
        registry.set_run_status(conn, run_id=run_id, status="completed", now=T0 + 150)
    clock.now = T0 + 300
    evaluator.tick()
    assert run_id not in evaluator._runs
    g = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["goodput"]
    assert g["end"] == pytest.approx(T0 + 150)
    assert g["wall_s"] == pytest.approx(150.0)
    assert g["productive_s"] == pytest.approx(PRODUCTIVE)
    clock.now = T0 + 900
    assert evaluator.goodput(run_id) == g


def test_a_failing_goodput_read_does_not_stop_the_fault_handling(
        client: TestClient, clock: FakeClock, evaluator: Evaluator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    run = SynthRun(client, "alpha").register()
    run.train(range(10), t0=T0 + 5, dt=2.0)
    run.crash(node=1, rank=3, t=T0 + 30)

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(goodput_store, "rank_step_groups_after", broken)
    clock.now = T0 + 32
    evaluator.tick()
    acts = client.get("/api/v1/runs/alpha/actions", headers=OPERATOR).json()["actions"]
    assert [a["kind"] for a in acts] == ["restart"]  # the crash was handled
    assert client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["goodput"] is None
    monkeypatch.undo()
    evaluator.tick()  # it starts over from the run's start
    g = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["goodput"]
    assert g is not None and g["steps_final"] == 10


def _silent_run(client: TestClient, clock: FakeClock, evaluator: Evaluator) -> SynthRun:
    """Both agents train steps 0..29 (the last ends at 63, its batch received then), then go
    silent; at 95 (past the 30 s node-lost deadline) the evaluator finds no agent running."""
    run = SynthRun(client, "idle").register()
    run.train(A0_STEPS, t0=T0 + 5, dt=2.0, checkpoint_every=10, clock=clock)
    evaluator.tick()
    clock.now = T0 + 95
    evaluator.tick()
    return run


def _presence(db: Database) -> list[tuple[str, float, dict[str, Any]]]:
    with db.read() as conn:
        _, rows = goodput_store.presence_events_after(conn, run_id=1, after_id=0)
    return [(r["name"], r["t"], r["details"]) for r in rows]


def test_idle_is_the_time_no_agent_ran_until_one_registers(
        client: TestClient, clock: FakeClock, evaluator: Evaluator, db: Database) -> None:
    """From the newest heartbeat (63) nothing runs; the node-lost detection (until 95)
    comes first, then idle until an agent registers again (200)."""
    run = _silent_run(client, clock, evaluator)
    clock.now = T0 + 100
    evaluator.tick()  # (one agents_down, not one a tick)
    clock.now = T0 + 200
    run.register()  # the agents are started again (a requeued job)
    clock.now = T0 + 210
    evaluator.tick()
    names = [n for n, _, _ in _presence(db)]
    assert names == ["agent_registered"] * 2 + ["agents_down"] + ["agent_registered"] * 2
    down = next(d for n, _, d in _presence(db) if n == "agents_down")
    assert down["since"] == pytest.approx(T0 + 63)
    g = client.get("/api/v1/runs/idle", headers=OPERATOR).json()["goodput"]
    assert g["badput_s"]["idle"] == pytest.approx(200 - 95, abs=1e-4)
    assert g["badput_s"]["detection"] == pytest.approx(95 - 63, abs=1e-4)
    assert "idle" not in g["not_measured"]
    assert sum(g["badput_s"].values()) + g["productive_s"] == pytest.approx(g["wall_s"])


def test_idle_ends_when_an_agent_is_heard_from_without_registering(
        client: TestClient, clock: FakeClock, evaluator: Evaluator, db: Database) -> None:
    """Agents out of reach (a network split, their workers waiting) that come back: the
    idle time ends at the heartbeat the evaluator sees (150)."""
    run = _silent_run(client, clock, evaluator)
    clock.now = T0 + 150
    for node in range(run.nodes):
        run.send(node, [{"type": "heartbeat", "t": clock.now, "attempt": 0,
                         "state": "running"}])
    clock.now = T0 + 151
    evaluator.tick()
    evaluator.tick()  # (read back)
    assert [n for n, _, _ in _presence(db)][-2:] == ["agents_down", "agents_up"]
    assert _presence(db)[-1][2]["at"] == pytest.approx(T0 + 150)
    g = client.get("/api/v1/runs/idle", headers=OPERATOR).json()["goodput"]
    assert g["badput_s"]["idle"] == pytest.approx(150 - 95, abs=1e-4)


def test_a_supervisor_that_just_started_calls_no_agent_gone(
        client: TestClient, clock: FakeClock, evaluator: Evaluator, db: Database) -> None:
    """The agents' heartbeats are old because the supervisor was away, not the agents."""
    run = SynthRun(client, "idle").register()
    run.train(A0_STEPS, t0=T0 + 5, dt=2.0, clock=clock)
    clock.now = T0 + 95
    evaluator.observe_from_now()
    evaluator.tick()
    assert "agents_down" not in [n for n, _, _ in _presence(db)]


SPIKE_STEP, SPIKE_DT = 120, 0.05  # the spike's first step; one step every 50 ms


def test_a_spikes_detection_latency_runs_from_its_first_step_to_the_incident(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """The workers train through a loss spike: its detection latency is the time from the
    spike's first step (that step's timestamp) to the incident, not 0 (no exit report, and
    steps went on until the incident), and the same on the run, its goodput feed, the
    dashboard's series feed and /metrics."""
    run = SynthRun(client, "spiky").register()
    t0 = T0 + 5
    run.train(range(0, SPIKE_STEP + 54), t0=t0, dt=SPIKE_DT, checkpoint_every=20,
              spike=(SPIKE_STEP, 10**6), clock=clock)
    t_spike = t0 + SPIKE_STEP * SPIKE_DT
    clock.now = t_incident = t0 + (SPIKE_STEP + 53) * SPIKE_DT + 0.1  # 2.75 s and 54 steps later
    evaluator.tick()  # the spike: an incident and a rollback
    (inc,) = client.get("/api/v1/runs/spiky/incidents", headers=OPERATOR).json()["incidents"]
    assert inc["kind"] == "loss_spike" and inc["opened_at"] == pytest.approx(t_incident)
    assert inc["details"]["start_step"] == SPIKE_STEP
    assert inc["details"]["started_at"] == pytest.approx(t_spike)
    clock.advance(5.0)
    evaluator.tick()
    want = pytest.approx(t_incident - t_spike, abs=1e-6)
    g = client.get("/api/v1/runs/spiky", headers=OPERATOR).json()["goodput"]
    assert g["badput_s"]["detection"] == want
    assert sum(g["badput_s"].values()) + g["productive_s"] == pytest.approx(g["wall_s"])
    cur = client.get("/api/v1/runs/spiky/goodput", headers=OPERATOR).json()["current"]
    assert cur["badput_s"]["detection"] == want
    feed = client.get("/dashboard/api/runs/spiky/series", headers=OPERATOR).json()["goodput"]
    assert feed["badput_s"]["detection"] == want
    text = client.get("/metrics", headers=OPERATOR).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    (det,) = [s.value for s in fams["trainwarden_run_badput_seconds"].samples
              if s.labels["run"] == "spiky" and s.labels["cause"] == "detection"]
    assert det == want


def test_the_pages_goodput_bar_draws_every_part_the_api_gives() -> None:
    """The run page's bar and legend name every badput cause ``GET .../goodput`` returns,
    in the API's order, each with a colour: a part the page leaves out is wall time the
    user cannot see."""
    import re
    from pathlib import Path

    from trainwarden.supervisor.goodput import live

    static = Path(live.__file__).resolve().parents[1] / "dashboard" / "static"
    js = (static / "dashboard.js").read_text()
    block = js[js.index("var GOODPUT_PARTS = ["):]
    block = block[:block.index("]];") + 3]
    keys = re.findall(r'\["([a-z_]+)", "', block)
    assert keys == ["productive", *live.CAUSES], keys
    css = (static / "dashboard.css").read_text()
    missing = [k for k in keys if not re.search(rf"\.seg-{k} \{{ background: #[0-9a-f]+", css)]
    assert not missing, missing

"""The agents' clocks decide nothing: the newest checkpoint is the one of the highest step on
the current lineage, and an agent timestamp that is not finite or further off the
supervisor's clock than the configured skew is stored as the receive time and counted in the
agent's ``clock_skew`` event."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from tests.supervisor.sup_helpers import (
    OPERATOR,
    FakeClock,
    as_agent,
    command_rows,
    crash,
    ingest,
    make_settings,
    register,
    step,
)
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store import tables
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.ingest import CLOCK_SKEW_EVENT_S, IngestConfig

DAY = 86_400.0


def checkpoint(s: int, t: float | str) -> dict[str, Any]:
    return {"type": "checkpoint", "step": s, "path": f"/ck/step_{s}", "bytes": 5, "t": t,
            "lineage": "a0", "save_s": 0.1}


def post(client: TestClient, body: dict[str, Any]) -> dict[str, Any]:
    """An ingest body as the agent writes it (NaN/Infinity tokens included)."""
    r = client.post("/api/v1/ingest", content=json.dumps(body),
                    headers={**as_agent(client, body["agent_id"]),
                                "content-type": "application/json"})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def skew_events(client: TestClient, run: str = "r1") -> list[dict[str, Any]]:
    evs = client.get(f"/api/v1/runs/{run}/events", headers=OPERATOR).json()["events"]
    return [e for e in evs if e["name"] == "clock_skew"]


def test_the_newest_checkpoint_is_the_highest_step_whatever_the_agent_clock_says(
        client: TestClient, evaluator: Evaluator, db: Database, clock: FakeClock) -> None:
    """A step-1 checkpoint stamped in the future must not be the "newest" (a crash restart
    would resume 98 steps back).  Stamped within the allowed skew (an hour ahead), so the time
    is kept as reported: the ordering alone must not use it."""
    a = register(client)["agent_id"]
    now = clock()
    ingest(client, a, 0, [step(0, s, world_size=1, t=now) for s in range(100)]
           + [checkpoint(99, now - 10), checkpoint(1, now + 3600)])
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["checkpoint"]["step"] == 99
    cps = client.get("/api/v1/runs/r1/checkpoints", headers=OPERATOR).json()["checkpoints"]
    assert [c["step"] for c in cps] == [99, 1]  # newest first, by step
    ingest(client, a, 1, [crash()])
    evaluator.tick()
    with db.read() as conn:
        (cmd,) = command_rows(conn, run["id"])
    assert cmd["plan"]["checkpoint"] == "/ck/step_99"


def test_a_step_saved_again_by_a_later_attempt_is_the_newer_save(
        client: TestClient, clock: FakeClock) -> None:
    a = register(client)["agent_id"]
    now = clock()
    ingest(client, a, 0, [{**checkpoint(50, now + 600), "path": "/ck/old/step_50"}])
    ingest(client, a, 1, [{**checkpoint(50, now - 600), "attempt": 1, "lineage": "a1"}],
           attempt=1)
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["checkpoint"]["path"] == "/ck/step_50"


BAD_TIMES = [math.inf, -math.inf, math.nan, 1e300, -1e15, 2 * DAY, -31 * DAY]


@pytest.mark.parametrize("off", BAD_TIMES, ids=str)
def test_an_agent_time_off_the_clock_is_stored_as_the_receive_time(
        client: TestClient, db: Database, clock: FakeClock, off: float) -> None:
    a = register(client)["agent_id"]
    now = clock()
    t = off if not math.isfinite(off) or abs(off) > 100 * DAY else now + off
    items = [step(0, 1, world_size=1, t=t), checkpoint(1, t),
             {"type": "event", "name": "note", "t": t, "message": "hi"},
             {"type": "heartbeat", "t": t}, crash()]
    items[-1]["t"] = t
    post(client, {"agent_id": a, "seq": 0, "sent_at": t, "attempt": 0, "items": items})
    with db.read() as conn:
        stored = [
            conn.execute(select(tables.rank_steps.c.t)).scalar_one(),
            conn.execute(select(tables.ranks.c.t)).scalar_one(),
            conn.execute(select(tables.step_aggregates.c.t_first,
                                tables.step_aggregates.c.t_last)).one()[1],
            conn.execute(select(tables.checkpoints.c.t)).scalar_one(),
            conn.execute(select(tables.exits.c.t)).scalar_one(),
            conn.execute(select(tables.events.c.t).where(
                tables.events.c.name == "note")).scalar_one(),
        ]
    assert stored == [now] * len(stored)
    (ev,) = skew_events(client)
    assert ev["t"] == now
    assert ev["details"]["count"] == 6  # sent_at and the five items
    assert ev["details"]["fields"] == {"sent_at": 1, "step": 1, "checkpoint": 1, "event": 1,
                                       "heartbeat": 1, "exit": 1}
    assert ev["details"]["nonfinite"] == (0 if math.isfinite(off) else 6)


def test_a_time_within_the_skew_is_kept_and_counts_nothing(
        client: TestClient, db: Database, clock: FakeClock) -> None:
    a = register(client)["agent_id"]
    now = clock()
    ingest(client, a, 0, [step(0, 1, world_size=1, t=now - 3600),
                          checkpoint(1, now + 3600)])
    with db.read() as conn:
        assert conn.execute(select(tables.rank_steps.c.t)).scalar_one() == now - 3600
        assert conn.execute(select(tables.checkpoints.c.t)).scalar_one() == now + 3600
    assert skew_events(client) == []


def test_a_missing_time_takes_the_batch_time_and_a_bad_batch_time_the_receive_time(
        client: TestClient, db: Database, clock: FakeClock) -> None:
    a = register(client)["agent_id"]
    now = clock()
    no_t = {k: v for k, v in step(0, 1, world_size=1).items() if k != "t"}
    post(client, {"agent_id": a, "seq": 0, "sent_at": now - 5, "items": [no_t]})
    post(client, {"agent_id": a, "seq": 1, "sent_at": math.nan,
                  "items": [{**no_t, "step": 2}]})
    with db.read() as conn:
        ts = [r[0] for r in conn.execute(select(tables.rank_steps.c.t)
                                         .order_by(tables.rank_steps.c.step))]
    assert ts == [now - 5, now]
    (ev,) = skew_events(client)
    assert ev["details"]["fields"] == {"sent_at": 1}


def test_one_clock_skew_event_per_agent_per_hour_counts_every_replaced_time(
        client: TestClient, clock: FakeClock) -> None:
    a = register(client)["agent_id"]
    for seq in range(3):
        ingest(client, a, seq, [step(0, seq, world_size=1, t=clock() + 5 * DAY)])
        clock.advance(60)
    (ev,) = skew_events(client)
    assert ev["details"]["count"] == 3
    assert ev["details"]["worst_offset_s"] == pytest.approx(5 * DAY)
    clock.advance(CLOCK_SKEW_EVENT_S)
    ingest(client, a, 3, [step(0, 3, world_size=1, t=clock() + 5 * DAY)])
    assert [e["details"]["count"] for e in skew_events(client)] == [1, 3]


def test_the_skew_is_a_setting(db: Database, clock: FakeClock) -> None:
    app = create_app(make_settings(ingest={"clock_ahead_s": 60, "clock_behind_s": 60}),
                     db=db, clock=clock, upgrade_schema=False, start_evaluator=False)
    with TestClient(app) as client:
        a = register(client)["agent_id"]
        ingest(client, a, 0, [step(0, 1, world_size=1, t=clock() + 120),
                              step(0, 2, world_size=1, t=clock() - 30)])
        (ev,) = skew_events(client)
        assert ev["details"]["fields"] == {"step": 1}  # 120 s ahead; 30 s behind passes
        assert ev["details"]["ahead_s"] == 60


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan])
def test_a_skew_setting_must_be_positive_seconds(bad: float) -> None:
    with pytest.raises(ValueError, match="clock_ahead_s"):
        IngestConfig(clock_ahead_s=bad)
    with pytest.raises(ValueError, match=r"ingest\.clock_behind_s"):
        SupervisorSettings(insecure_no_auth=True, ingest={"clock_behind_s": bad})


def test_the_issue_batches_leave_the_runs_list_and_the_run_page_working(
        client: TestClient, clock: FakeClock) -> None:
    """A step at t Infinity, 1e300 or -1e15, a checkpoint at 1e300, a GPU reading with a
    string where a number belongs: the runs list and the run page answered 500."""
    a = register(client)["agent_id"]
    gpus = {"available": True, "devices": [{"index": 0, "util_percent": "high",
                                            "mem_used_bytes": "lots", "temp_c": None}]}
    post(client, {"agent_id": a, "seq": 0, "sent_at": clock(), "items": [
        step(0, 1, world_size=1, t=math.inf), step(0, 2, world_size=1, t=1e300),
        step(0, 3, world_size=1, t=-1e15), checkpoint(3, 1e300),
        {"type": "heartbeat", "gpus": gpus, "workers": [{"rank": 0, "cpu_percent": "x"}]}]})
    for page in ("/", "/runs/r1", "/runs/r1/tables", "/api/v1/runs", "/api/v1/runs/r1"):
        r = client.get(page, headers=OPERATOR)
        assert r.status_code == 200, (page, r.text[:500])
    (agent,) = client.get("/api/v1/runs/r1", headers=OPERATOR).json()["agents"]
    assert agent["gpus"]["devices"] == [{"index": 0, "util_percent": None,
                                         "mem_used_bytes": None, "temp_c": None}]
    assert agent["workers"] == [{"rank": 0}]


def test_settings_default_the_skew_to_a_day_ahead_and_thirty_days_behind() -> None:
    s = SupervisorSettings(insecure_no_auth=True)
    assert (s.ingest.clock_ahead_s, s.ingest.clock_behind_s) == (DAY, 30 * DAY)

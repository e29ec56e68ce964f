"""Retention of the per-rank rows: the rollup store functions (what the summaries hold is
what the deleted rows said), and the evaluator's retention job keeping the window that the
straggler detector, the live goodput and the dashboard read."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    OPERATOR,
    FakeClock,
    ingest,
    make_settings,
    register,
    step,
    stored_rank_steps,
)
from trainwarden.supervisor.control.detection import straggler_findings
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.retention import Retention, RetentionConfig
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry
from trainwarden.supervisor.store import retention as store
from trainwarden.supervisor.store.db import Database


def _phase(s: int, r: int) -> dict[str, Any]:
    """Varied values: a NaN loss, a missing data time, a rank slower than the others."""
    return {"loss": float("nan") if (s, r) == (7, 1) else 1.0 + 0.01 * s + r,
            "data_s": None if (s, r) == (8, 2) else 0.01 * (1 + s % 3),
            "compute_s": 0.2 + 0.001 * r * s, "step_s": 0.3 + 0.0001 * s,
            "batch_index": 1000 + s}


def _send_steps(client: TestClient, agent: int, seq: int, steps: range, ranks: int,
                compute: Any = None, sent: list[dict[str, Any]] | None = None,
                **kw: Any) -> int:
    """Report ``steps`` of ``ranks`` ranks in batches under the body limit (the items are
    added to ``sent``); the next seq."""
    items = [step(r, s, world_size=ranks, **{**_phase(s, r), **kw,
                                             **({"compute_s": compute(s, r)} if compute else {})})
             for s in steps for r in range(ranks)]
    if sent is not None:
        sent.extend(items)
    for i in range(0, len(items), 150):
        ingest(client, agent, seq, items[i:i + 150])
        seq += 1
    return seq


def _expected(rows: list[dict[str, Any]], bucket_steps: int) -> dict[tuple[int, int], dict]:
    """The rollups the rows should give, computed here from the rows as stored."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for r in rows:
        key = (int(r["rank"]), r["step"] - r["step"] % bucket_steps)
        e = out.setdefault(key, {"rows": 0, "loss_nonfinite": 0, "step_first": r["step"],
                                 "step_last": r["step"],
                                 **{f"{m}_n": 0 for m in ("data_s", "compute_s", "step_s",
                                                          "loss")},
                                 **{f"{m}_sum": 0.0 for m in ("data_s", "compute_s", "step_s",
                                                              "loss")},
                                 "compute_s_max": 0.0, "loss_min": math.inf})
        e["rows"] += 1
        e["step_first"], e["step_last"] = min(e["step_first"], r["step"]), \
            max(e["step_last"], r["step"])
        for m in ("data_s", "compute_s", "step_s", "loss"):
            v = r[m]
            if v is None or not math.isfinite(v):
                continue
            e[f"{m}_n"] += 1
            e[f"{m}_sum"] += v
        e["compute_s_max"] = max(e["compute_s_max"], r["compute_s"])
        if math.isfinite(r["loss"]):
            e["loss_min"] = min(e["loss_min"], r["loss"])
        else:
            e["loss_nonfinite"] += 1
    return out


def _run_id(db: Database, name: str = "r1") -> int:
    with db.read() as conn:
        run = registry.get_run_by_name(conn, name=name)
    assert run is not None
    return int(run["id"])


def _check_rollups(got: list[dict[str, Any]], want: dict[tuple[int, int], dict]) -> None:
    by_key = {(int(g["rank"]), int(g["bucket_start"])): g for g in got}
    assert sorted(by_key) == sorted(want)
    for key, e in want.items():
        g = by_key[key]
        for name in ("rows", "step_first", "step_last", "loss_nonfinite", "data_s_n",
                     "compute_s_n", "step_s_n", "loss_n"):
            assert g[name] == e[name], (key, name)
        for name in ("data_s_sum", "compute_s_sum", "step_s_sum", "loss_sum", "compute_s_max",
                     "loss_min"):
            assert g[name] == pytest.approx(e[name], rel=1e-9), (key, name)


def test_roll_up_summarises_exactly_the_rows_it_deletes(client: TestClient, db: Database
                                                         ) -> None:
    agent = register(client)["agent_id"]
    _send_steps(client, agent, 0, range(0, 250), ranks=3)
    run_id = _run_id(db)
    with db.read() as conn:
        before = stored_rank_steps(conn, run_id)
    with db.write() as conn:
        n = store.roll_up(conn, run_id=run_id, attempt=0, step_from=0, step_to=200,
                          bucket_steps=100)
    old = [r for r in before if r["step"] < 200]
    assert n == len(old)
    with db.read() as conn:
        kept = stored_rank_steps(conn, run_id)
        got = store.rollups(conn, run_id=run_id, attempt=0)
        kept_from = store.kept_from_step(conn, run_id=run_id, attempt=0)
        batches = rec.batch_indexes(conn, run_id=run_id, steps=[50, 199, 220])
    assert kept == [r for r in before if r["step"] >= 200]
    assert kept_from == 200
    _check_rollups(got, _expected(old, 100))
    # A rollback names batches from a checkpoint's step: still there once rolled up.
    assert batches == {50: 1050, 199: 1199, 220: 1220}


def test_a_late_row_adds_to_its_rolled_up_bucket(client: TestClient, db: Database) -> None:
    agent = register(client)["agent_id"]
    seq = _send_steps(client, agent, 0, range(0, 120), ranks=2)
    run_id = _run_id(db)
    with db.write() as conn:
        store.roll_up(conn, run_id=run_id, attempt=0, step_from=0, step_to=100,
                      bucket_steps=50)
    ingest(client, agent, seq, [step(1, 10, world_size=2, compute_s=5.0, t=200.0)])
    with db.write() as conn:
        n = store.roll_up(conn, run_id=run_id, attempt=0, step_from=0, step_to=100,
                          bucket_steps=50)
    with db.read() as conn:
        (r,) = store.rollups(conn, run_id=run_id, attempt=0, rank=1)[:1]
    assert n == 1
    assert r["rows"] == 51
    assert r["compute_s_max"] == 5.0
    assert r["t_last"] == 200.0


@pytest.fixture
def retained(db: Database, clock: FakeClock) -> Iterator[TestClient]:
    settings = make_settings(retention={"keep_steps": 300, "bucket_steps": 100,
                                        "chunk_rows": 200, "chunks_per_tick": 2})
    app = create_app(settings, db=db, clock=clock, upgrade_schema=False,
                     start_evaluator=False)
    with TestClient(app) as c:
        yield c


def test_retention_keeps_the_window_the_detectors_and_pages_read(
        retained: TestClient, db: Database, clock: FakeClock) -> None:
    ev: Evaluator = retained.app.state.evaluator  # type: ignore[attr-defined]
    agent = register(retained)["agent_id"]
    seq, sent = 0, []
    for lo in range(0, 640, 40):  # rank 1 turns 1.5x slower for the last 80 steps
        clock.advance(20.0)
        seq = _send_steps(retained, agent, seq, range(lo, lo + 40), ranks=2, t=clock.now,
                          loss=1.0, sent=sent,
                          compute=lambda s, r: 0.3 if r == 1 and s >= 560 else 0.2)
        ev.tick()
    run_id = _run_id(db)
    for _ in range(50):  # the job's slices are bounded: tick until it has caught up
        if ev.retention.tick(db) == 0:
            break
    with db.read() as conn:
        kept = stored_rank_steps(conn, run_id)
        got = store.rollups(conn, run_id=run_id, attempt=0)
    assert min(r["step"] for r in kept) == 639 - 299
    _check_rollups(got, _expected([r for r in sent if r["step"] < 340], 100))
    # The detectors, the pages and the live goodput on the kept window
    incidents = retained.get("/api/v1/runs/r1/incidents", headers=OPERATOR).json()["incidents"]
    assert [(i["kind"], i["rank"]) for i in incidents] == [("straggler", 1)]
    with db.read() as conn:
        run = registry.get_run(conn, run_id=run_id)
        again = straggler_findings(conn, run, cfg=ev.detection, open_ranks=set())
    assert [f.rank for f in again] == [1]  # a fresh window, read from the kept rows
    page = retained.get("/runs/r1", headers=OPERATOR)
    assert page.status_code == 200
    ranks = retained.get("/api/v1/runs/r1/ranks", headers=OPERATOR).json()["ranks"]
    assert [r["rank"] for r in ranks if r["slow"]] == [1]
    assert (ev.goodput(run_id) or {})["steps_final"] == 640
    rolled = retained.get("/api/v1/runs/r1/rank-rollups", params={"rank": 1},
                          headers=OPERATOR).json()
    assert (rolled["kept_from_step"], rolled["rolled_up_steps"]) == (340, [0, 339])
    assert [(b["bucket_start"], b["rows"]) for b in rolled["rollups"]] == [
        (0, 100), (100, 100), (200, 100), (300, 40)]
    fresh = Evaluator(db, ev.cfg, clock=clock, detection=ev.detection,
                      retention=RetentionConfig(keep_steps=300))
    fresh.tick()  # a restarted supervisor's goodput starts over from the kept rows
    assert (fresh.goodput(run_id) or {})["steps_final"] == 300


def test_a_window_shorter_than_the_detectors_read_is_refused() -> None:
    with pytest.raises(ValueError, match=r"raise retention\.keep_steps"):
        make_settings(retention={"keep_steps": 100})


def test_the_refusal_names_the_reader_that_needs_more() -> None:
    with pytest.raises(ValueError, match=r"detection\.straggler_table_steps"):
        make_settings(detection={"straggler_table_steps": 2000})


def test_batch_keys_beyond_the_newest_are_pruned_and_replays_still_answered(
        client: TestClient, db: Database) -> None:
    agent = register(client)["agent_id"]
    for seq in range(30):
        ingest(client, agent, seq, [step(0, seq)])
    with db.write() as conn:
        gone = store.prune_batch_keys(conn, agent_ids=[agent], keep=10)
    assert gone == 20
    replay = ingest(client, agent, 25, [step(0, 25)])  # the reply was lost: sent again
    assert replay["duplicate"] is True
    assert register(client)["next_seq"] == 30


def test_a_step_of_more_ranks_than_a_slice_is_split_by_rank(client: TestClient, db: Database
                                                            ) -> None:
    agent = register(client)["agent_id"]
    sent: list[dict[str, Any]] = []
    _send_steps(client, agent, 0, range(0, 310), ranks=3, sent=sent)
    job = Retention(RetentionConfig(keep_steps=300, bucket_steps=100, chunk_rows=2,
                                    chunks_per_tick=1))
    slices = []
    while (n := job.tick(db)) and len(slices) < 100:
        slices.append(n)
    run_id = _run_id(db)
    with db.read() as conn:
        got = store.rollups(conn, run_id=run_id, attempt=0)
        kept_from = store.kept_from_step(conn, run_id=run_id, attempt=0)
    assert max(slices) == 2
    assert sum(slices) == 30
    assert kept_from == 10
    _check_rollups(got, _expected([r for r in sent if r["step"] < 10], 100))

"""Store functions directly, on SQLite and Postgres: grouped ingest, NaN, downsampling."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from sqlalchemy import select

from tests.supervisor.sup_helpers import count_rows, step
from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.store import ingest, reads, registry, tables, windows
from trainwarden.supervisor.store._sql import join_float, split_float
from trainwarden.supervisor.store.db import Database


def batch(agent_id: int, seq: int, items: list[dict[str, Any]]) -> wire.IngestBatch:
    return wire.IngestBatch.model_validate(
        {"agent_id": agent_id, "seq": seq, "sent_at": 5.0, "attempt": 0, "items": items})


def agents(db: Database, n: int) -> list[int]:
    with db.write() as c:
        return [registry.register_agent(c, req=wire.RegisterRequest(run="r", node=f"n{i}"),
                                    now=1.0)["agent_id"] for i in range(n)]


def test_heartbeat_health_is_stored_and_the_last_gpu_reading_stands(db: Database) -> None:
    """Worker CPU/RSS, disk free and total, and GPU readings reach the agent row; a heartbeat
    without GPU readings (they are read every few seconds) keeps the last ones."""
    (a,) = agents(db, 1)
    gpus = {"available": True, "devices": [{"index": 0, "name": "H200", "util_percent": 97,
                                            "temp_c": 61, "ecc_uncorrected": 0}]}
    beat = {"type": "heartbeat", "state": "running", "disk_free_bytes": 10,
            "disk_total_bytes": 100, "gpus": gpus,
            "workers": [{"rank": 0, "local_rank": 0, "pid": 11, "cpu_percent": 99.5,
                         "rss_bytes": 300 << 20, "cmdline": "not kept"},
                        {"rank": 1, "cpu_percent": float("nan")}]}
    with db.write() as c:
        ingest.ingest_batches(c, batches=[batch(a, 0, [beat])], now=10.0)
        ingest.ingest_batches(c, batches=[batch(a, 1, [{
            "type": "heartbeat", "state": "running", "disk_free_bytes": 9,
            "workers": [{"rank": 0, "pid": 11, "cpu_percent": 50.0}]}])], now=11.0)
    with db.read() as c:
        (ag,) = registry.run_agents(c, run_id=1)
    assert (ag["disk_free_bytes"], ag["disk_total_bytes"]) == (9, 100)
    assert ag["workers"] == [{"rank": 0, "pid": 11, "cpu_percent": 50.0}]
    assert ag["gpus"] == gpus
    with db.write() as c:
        ingest.ingest_batches(c, batches=[batch(a, 2, [beat])], now=12.0)
    with db.read() as c:
        (ag,) = registry.run_agents(c, run_id=1)
    assert ag["workers"] == [{"rank": 0, "local_rank": 0, "pid": 11, "cpu_percent": 99.5,
                              "rss_bytes": 300 << 20}, {"rank": 1}]


def test_group_ingest_merges_and_isolates(db: Database) -> None:
    a0, a1 = agents(db, 2)
    group = [
        batch(a0, 0, [step(0, 1, loss=1.0), step(1, 1, loss=float("nan"))]),
        batch(a1, 0, [step(2, 1, loss=3.0), {"type": "heartbeat", "state": "running",
                                             "disk_free_bytes": 123}]),
        batch(a0, 0, [step(0, 1, loss=99.0)]),  # same key, other content: refused
        batch(999, 0, [step(0, 1)]),  # unknown agent: refused, stores nothing
        batch(a0, 1, [step(0, 2, loss=2.0), {"type": "event", "name": "worker_started"}]),
    ]
    with db.write() as c:
        out = ingest.ingest_batches(c, batches=group, now=10.0)
    assert [getattr(r, "duplicate", None) for r in out] == [False, False, None, None, False]
    assert isinstance(out[2], ingest.SeqConflict)
    assert isinstance(out[3], ingest.UnknownAgent)
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 4
        assert count_rows(c, "ingested_batches") == 3
        assert count_rows(c, "events") == 2 + 1  # the two registrations, worker_started
        pts = reads.steps(c, run_id=1, step_from=None, step_to=None, max_points=100)["points"]
        ranks = reads.rank_latest(c, run_id=1)
        ags = {a["id"]: a for a in registry.run_agents(c, run_id=1)}
    assert [(p["step_from"], p["ranks"], p["loss_nonfinite"]) for p in pts] == [(1, 3, 1),
                                                                               (2, 1, 0)]
    assert pts[0]["loss_mean"] == 2.0 and pts[0]["loss_max"] == 3.0
    assert {r["rank"]: r["step"] for r in ranks} == {0: 2, 1: 1, 2: 1}
    assert math.isnan(next(r["loss"] for r in ranks if r["rank"] == 1))
    assert ags[a1]["disk_free_bytes"] == 123 and ags[a1]["state"] == "running"
    # Replaying the whole group stores nothing more.
    with db.write() as c:
        again = ingest.ingest_batches(c, batches=group, now=11.0)
    assert all(getattr(r, "duplicate", True) for r in again)
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 4


def test_step_aggregates_and_latest_ranks_equal_a_plain_computation(db: Database) -> None:
    """The ingest loop's per-step aggregates and each rank's newest row, over steps out of
    order and times out of order, NaN, infinite and missing values, in one group and across
    groups, equal what a plain computation over the rows gives."""
    rng = random.Random(7)
    a0, a1 = agents(db, 2)
    specials = [None, float("nan"), float("inf"), float("-inf")]
    rows: list[dict[str, Any]] = []
    for _ in range(120):
        rank, st = rng.randrange(4), rng.randrange(6)
        loss = rng.choice([*specials, *(rng.uniform(0, 5) for _ in range(6))])
        rows.append(step(rank, st, loss=loss, t=rng.uniform(50, 150),
                         grad_norm=rng.choice([1.0, float("nan")]),
                         samples=rng.choice([None, 0, 8]), tokens=rng.choice([None, 512]),
                         step_s=rng.choice([None, rng.uniform(0.1, 0.9)])))
    seq = {a0: 0, a1: 0}
    for lo in range(0, len(rows), 30):  # four groups of several batches each
        group = []
        for i in range(lo, lo + 30, 10):
            a = a0 if rows[i]["rank"] < 2 else a1
            group.append(batch(a, seq[a], [r for r in rows[i:i + 10]]))
            seq[a] += 1
        with db.write() as c:
            ingest.ingest_batches(c, batches=group, now=200.0)
    with db.read() as c:
        stored = {r["step"]: r for r in c.execute(
            select(tables.step_aggregates)).mappings()}
        latest = {r["rank"]: r for r in c.execute(select(tables.ranks)).mappings()}
    for st in sorted({r["step"] for r in rows}):
        mine = [r for r in rows if r["step"] == st]
        finite_losses = [r["loss"] for r in mine
                         if r["loss"] is not None and math.isfinite(r["loss"])]
        got = stored[st]
        assert got["ranks"] == len(mine), st
        assert got["loss_count"] == len(finite_losses), st
        assert got["loss_sum"] == pytest.approx(sum(finite_losses) if finite_losses else None)
        assert got["loss_min"] == (min(finite_losses) if finite_losses else None), st
        assert got["loss_max"] == (max(finite_losses) if finite_losses else None), st
        assert got["loss_nonfinite"] == sum(r["loss"] is not None and not math.isfinite(
            r["loss"]) for r in mine), st
        assert got["grad_norm_nonfinite"] == sum(math.isnan(r["grad_norm"]) for r in mine)
        assert got["samples"] == sum(r["samples"] or 0 for r in mine), st
        assert got["tokens"] == sum(r["tokens"] or 0 for r in mine), st
        step_s = [r["step_s"] for r in mine if r["step_s"] is not None]
        assert got["step_s_max"] == (max(step_s) if step_s else None), st
        assert got["t_first"] == min(r["t"] for r in mine), st
        assert got["t_last"] == max(r["t"] for r in mine), st
    for rank in range(4):
        mine = [r for r in rows if r["rank"] == rank]
        newest = max(r["step"] for r in mine)
        # of the rows of its newest step, the last one sent
        want = [r for r in mine if r["step"] == newest][-1]
        assert (latest[rank]["step"], latest[rank]["t"]) == (newest, want["t"]), rank


def test_large_group_is_split_into_statements(db: Database) -> None:
    (a0,) = agents(db, 1)
    items = [step(r, s) for s in range(300) for r in range(8)]  # 2400 rows, several chunks
    with db.write() as c:
        ingest.ingest_batches(c, batches=[batch(a0, 0, items)], now=1.0)
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 2400
        assert count_rows(c, "step_aggregates") == 300


def test_split_and_join_float() -> None:
    for x in (1.5, None, math.inf, -math.inf):
        assert join_float(*split_float(x)) == x
    assert math.isnan(join_float(*split_float(math.nan)) or 0.0)


def test_ingest_writer_groups_and_answers_each_batch(db: Database) -> None:
    import asyncio

    from trainwarden.supervisor.ingest.writer import IngestWriter

    ids = agents(db, 3)
    writer = IngestWriter(db, clock=lambda: 50.0)

    async def main() -> list[Any]:
        subs = [writer.submit(batch(a, s, [step(i, s)]))
                for s in range(5) for i, a in enumerate(ids)]
        subs.append(writer.submit(batch(12345, 0, [])))
        return await asyncio.gather(*subs, return_exceptions=True)

    try:
        out = asyncio.run(main())
    finally:
        writer.stop()
    assert isinstance(out[-1], ingest.UnknownAgent)
    assert all(isinstance(r, ingest.IngestResult) and not r.duplicate for r in out[:-1])
    assert writer.batches == 16 and 1 <= writer.groups <= 16
    if db.is_sqlite:  # written on the loop: every batch submitted in one iteration, one group
        assert writer.inline
        assert writer.groups == 1
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 15
        assert count_rows(c, "step_aggregates") == 5


def test_ingest_writer_retries_a_failed_group_batch_by_batch(
        db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """One batch that breaks its group's transaction fails alone: its neighbours are stored
    and answered."""
    import asyncio

    import trainwarden.supervisor.ingest.writer as writer_mod
    from trainwarden.supervisor.ingest.writer import IngestWriter

    real = writer_mod.ingest_batches

    def breaks_on_seq_7(conn: Any, *, batches: Any, **kw: Any) -> Any:
        if any(b.seq == 7 for b in batches):
            raise RuntimeError("broken batch")
        return real(conn, batches=batches, **kw)

    monkeypatch.setattr(writer_mod, "ingest_batches", breaks_on_seq_7)
    ids = agents(db, 3)
    writer = IngestWriter(db, clock=lambda: 50.0)

    async def main() -> list[Any]:
        subs = [writer.submit(batch(a, 0, [step(i, 0)])) for i, a in enumerate(ids)]
        subs.append(writer.submit(batch(ids[0], 7, [step(0, 1)])))
        return await asyncio.gather(*subs, return_exceptions=True)

    try:
        out = asyncio.run(main())
    finally:
        writer.stop()
    assert all(isinstance(r, ingest.IngestResult) for r in out[:3]), out
    assert isinstance(out[3], RuntimeError)
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 3


def test_phase_window_read_incrementally_equals_a_full_read(db: Database) -> None:
    """The straggler window reads only the rows stored since its last refresh (late ones
    included) and keeps the newest steps: the same table as reading the window whole."""
    from trainwarden.supervisor.control.detection import PhaseWindow
    from trainwarden.supervisor.detect import pre_collective_table

    a0, a1 = agents(db, 2)
    window = PhaseWindow(steps=5)
    seq = {a0: 0, a1: 0}

    def send(agent: int, items: list[dict[str, Any]]) -> None:
        with db.write() as c:
            ingest.ingest_batches(c, batches=[batch(agent, seq[agent], items)], now=10.0)
        seq[agent] += 1

    send(a0, [step(0, s, data_s=0.01, compute_s=0.1 * (s + 1)) for s in range(4)])
    with db.read() as c:
        assert window.refresh(c, 1, 0) == pre_collective_table(
            windows.rank_phase_rows(c, run_id=1, attempt=0, step_from=0))
    send(a0, [step(0, s, data_s=0.01, compute_s=0.2) for s in range(4, 9)])
    send(a1, [step(1, s, data_s=0.02, compute_s=0.3) for s in range(2, 9)])  # late for 2, 3
    send(a1, [step(1, 3, attempt=1, data_s=5.0)])  # another attempt: not this window's
    with db.read() as c:
        table = window.refresh(c, 1, 0)
        full = pre_collective_table(windows.rank_phase_rows(c, run_id=1, attempt=0, step_from=4))
    assert table == full and sorted(table) == [4, 5, 6, 7, 8]
    assert table[8] == {0: pytest.approx(0.21), 1: pytest.approx(0.32)}
    with db.read() as c:  # nothing new: the same table, no rows read
        assert window.refresh(c, 1, 0) == full
        assert windows.rank_phase_rows_after(c, run_id=1, attempt=0,
                                          after_id=window.after_id) == []
        assert sorted(window.refresh(c, 1, 1)) == [3]  # a new attempt starts a new window


def test_delivered_step_is_the_newest_step_every_rank_of_the_attempt_sent(db: Database
                                                                           ) -> None:
    (a0,) = agents(db, 1)
    with db.read() as c:
        assert reads.delivered_step(c, run_id=1, attempt=0) is None  # nothing reported yet
    with db.write() as c:
        ingest.ingest_batches(c, batches=[batch(a0, 0, [step(0, s) for s in range(10)]
                                              + [step(1, s) for s in range(5)])], now=10.0)
    with db.read() as c:
        assert reads.delivered_step(c, run_id=1, attempt=0) == 4  # rank 1 is behind
    with db.write() as c:  # rank 0 goes on in attempt 1; rank 1 has not reported there yet
        ingest.ingest_batches(c, batches=[wire.IngestBatch.model_validate(
            {"agent_id": a0, "seq": 1, "sent_at": 5.0, "attempt": 1,
             "items": [step(0, s, attempt=1) for s in range(3)]})], now=11.0)
    with db.read() as c:
        assert reads.delivered_step(c, run_id=1, attempt=1) == 2
        assert reads.delivered_step(c, run_id=1, attempt=2) is None


def test_stragglers_are_judged_on_the_steps_every_rank_delivered(db: Database) -> None:
    """Ranks report through their own sockets and batches, so the newest steps often hold one
    rank only.  Those steps are not judged: one rank alone there would be compared with its
    own past (a tail of fast, noisy steps made a 2-rank run's rank 0 a "straggler")."""
    from trainwarden.supervisor.control.detection import (
        DetectionConfig,
        PhaseWindow,
        straggler_findings,
    )

    a0, a1 = agents(db, 2)
    cfg = DetectionConfig()
    window = PhaseWindow(cfg.straggler_table_steps)
    seq = {a0: 0, a1: 0}

    def send(agent: int, rank: int, steps: range, compute_s: float) -> None:
        with db.write() as c:
            ingest.ingest_batches(c, batches=[batch(agent, seq[agent], [
                step(rank, s, data_s=0.001, compute_s=compute_s) for s in steps])], now=10.0)
        seq[agent] += 1

    def findings() -> list[Any]:
        with db.read() as c:
            return straggler_findings(c, {"id": 1, "attempt": 0}, cfg=cfg, open_ranks=set(),
                                      window=window)

    send(a0, 0, range(0, 60), 0.05)
    send(a1, 1, range(0, 60), 0.05)
    assert findings() == []
    send(a0, 0, range(60, 90), 0.10)  # rank 0 twice as slow; rank 1's steps not in yet
    assert findings() == []
    send(a1, 1, range(60, 90), 0.05)  # now the peers say it
    (f,) = findings()
    assert f.rank == 0 and f.details["signal"] == "peers", f


def test_the_goodput_step_read_returns_every_value_exactly(db: Database) -> None:
    """The rows come packed one result row per step (as text): every value comes back as
    stored, NULLs are left out, the limit and the cursor cut at a row (a step read in two
    parts comes back in two groups)."""
    import math
    import random

    from sqlalchemy import select

    from trainwarden.supervisor.store import goodput
    from trainwarden.supervisor.store.tables import rank_steps

    rng = random.Random(5)
    with db.write() as conn:
        reg = registry.register_agent(conn, req=wire.RegisterRequest(run="packed", node="n"),
                                      now=1.0)
        rows = []
        for s in range(7):
            for r in range(13):
                rows.append({
                    "run_id": reg["run_id"], "attempt": s // 4, "step": s, "rank": r,
                    "t": 1796187468.846339 + s + rng.random() / 3,
                    "batch_index": s * 13 + r,
                    "data_s": None if r == 3 else rng.random() / 7,
                    "compute_s": None if r == 4 else (math.inf if r == 5 else 0.1 + 0.2),
                    "step_s": None if s == 2 else rng.random() * 1e-9,
                    "loss": 1.0, "loss_special": None, "grad_norm": 1.0,
                    "grad_norm_special": None, "lr": 1e-3})
        conn.execute(tables.rank_steps.insert(), rows)
    c = rank_steps.c
    with db.read() as conn:
        plain = [tuple(x) for x in conn.execute(
            select(c.id, c.attempt, c.step, c.rank, c.t, c.data_s, c.compute_s, c.step_s)
            .where(c.run_id == reg["run_id"]).order_by(c.id))]

        def expected(part: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
            out = []
            for key in sorted({(a, s) for _, a, s, *_ in part}):
                mine = [x for x in part if (x[1], x[2]) == key]
                out.append((*key, max(x[4] for x in mine), [x[3] for x in mine],
                            [x[7] for x in mine if x[7] is not None],
                            [x[5] for x in mine if x[5] is not None],
                            [x[5] + x[6] for x in mine
                             if x[5] is not None and x[6] is not None]))
            return out

        def read(after: int, limit: int) -> tuple[int, list[Any]]:
            return goodput.rank_step_groups_after(conn, run_id=reg["run_id"], after_id=after,
                                                  limit=limit)

        upto, got = read(0, 10_000)
        assert upto == plain[-1][0]
        assert [g[:3] for g in got] == [e[:3] for e in expected(plain)]
        for g, e in zip(got, expected(plain), strict=True):  # (the store's order per step)
            assert sorted(g[3]) == sorted(e[3]), e[:2]
            assert sorted(g[4]) == sorted(e[4]), e[:2]
            assert sorted(g[5]) == sorted(e[5]), e[:2]
            assert sorted(g[6]) == sorted(e[6]), e[:2]
        upto, first = read(0, 20)
        assert upto == plain[19][0]
        assert [(g[0], g[1], sorted(g[3])) for g in first] == \
            [(e[0], e[1], sorted(e[3])) for e in expected(plain[:20])]
        upto2, rest = read(upto, 10_000)
        assert [(g[0], g[1], sorted(g[3])) for g in rest] == \
            [(e[0], e[1], sorted(e[3])) for e in expected(plain[20:])]
        assert read(upto2, 10) == (upto2, [])


def test_numbered_placeholders_for_the_raw_cursor() -> None:
    """Postgres multi-row statements go unparsed on a raw cursor: each %s becomes the next
    $n and an escaped %% a literal percent sign."""
    from trainwarden.supervisor.store.ingest.statements import numbered as _numbered

    assert _numbered("INSERT INTO t (a, b) VALUES (%s, %s), (%s, %s)") == (
        "INSERT INTO t (a, b) VALUES ($1, $2), ($3, $4)")
    assert _numbered("SELECT %s WHERE x LIKE 'a%%' AND y = %s") == (
        "SELECT $1 WHERE x LIKE 'a%' AND y = $2")


def test_a_group_of_many_batches_is_stored_whole(db: Database) -> None:
    """A group large enough for multi-row statements of hundreds of rows (the raw-cursor
    path on Postgres) stores every row once and answers every batch."""
    ids = agents(db, 4)
    batches = [batch(a, s, [step(r, s) for r in range(8 * i, 8 * i + 8)])
               for s in range(40) for i, a in enumerate(ids)]
    with db.write() as c:
        out = ingest.ingest_batches(c, batches=batches, now=50.0)
    assert all(isinstance(r, ingest.IngestResult) and not r.duplicate for r in out)
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 4 * 8 * 40
        assert count_rows(c, "step_aggregates") == 40
    with db.write() as c:  # the same group again: all duplicates, nothing more stored
        again = ingest.ingest_batches(c, batches=batches, now=51.0)
    assert all(isinstance(r, ingest.IngestResult) and r.duplicate for r in again)
    with db.read() as c:
        assert count_rows(c, "rank_steps") == 4 * 8 * 40

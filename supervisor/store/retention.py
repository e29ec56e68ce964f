"""The rollup of old per-rank rows (what ``trainwarden.supervisor.control.retention`` runs):
``rank_steps``
rows
beyond the kept window are deleted in bounded slices, each slice's rows summarised per rank
and bucket of steps into ``rank_rollups`` and rank 0's batch indexes kept in
``step_batches``, in the same short write transaction.  Keyword-only functions taking a
``Connection``."""

from __future__ import annotations

from typing import Any

from sqlalchemy import Connection, bindparam, delete, func, select

from trainwarden.supervisor.store._sql import greatest, insert, least, nsum
from trainwarden.supervisor.store.tables import (
    agents,
    ingested_batches,
    rank_rollups,
    rank_steps,
    runs,
    step_aggregates,
    step_batches,
)

# (value column, the rollup's measures of it): sums and maxima of the phase times, the loss
# with its minimum too.
_MEASURES: dict[str, tuple[str, ...]] = {
    "data_s": ("sum", "max"), "compute_s": ("sum", "max"), "step_s": ("sum", "max"),
    "loss": ("sum", "min", "max"),
}
_KEY = ("run_id", "attempt", "rank", "bucket_start")


def run_ids(conn: Connection) -> list[int]:
    return [int(r[0]) for r in conn.execute(select(runs.c.id).order_by(runs.c.id))]


def oldest_rows(conn: Connection, *, run_id: int) -> tuple[int, int] | None:
    """(attempt, step) of the run's oldest per-rank rows: the lowest attempt that has rows,
    and its lowest step (two lookups in ix_rank_steps_run_attempt_step)."""
    c = rank_steps.c
    attempt = conn.execute(select(func.min(c.attempt)).where(c.run_id == run_id)).scalar_one()
    if attempt is None:
        return None
    step = conn.execute(select(func.min(c.step)).where(c.run_id == run_id,
                                                       c.attempt == attempt)).scalar_one()
    return None if step is None else (int(attempt), int(step))


def lowest_rank(conn: Connection, *, run_id: int, attempt: int, step: int) -> int | None:
    """The lowest rank with a row at one step of a run attempt."""
    c = rank_steps.c
    v = conn.execute(select(func.min(c.rank)).where(c.run_id == run_id, c.attempt == attempt,
                                                    c.step == step)).scalar_one()
    return None if v is None else int(v)


def newest_attempt(conn: Connection, *, run_id: int) -> int | None:
    """The run's newest attempt with a step (what the pages' per-rank views show)."""
    v = conn.execute(select(func.max(step_aggregates.c.attempt))
                     .where(step_aggregates.c.run_id == run_id)).scalar_one()
    return None if v is None else int(v)


_DELETE_COLS = ("rank", "step", "t", "batch_index", "data_s", "compute_s", "step_s", "loss",
                "loss_special")
_delete_sql: dict[str, tuple[str, tuple[str, ...]]] = {}


def _delete_statement(conn: Connection) -> tuple[str, tuple[str, ...]]:
    """The slice's DELETE ... RETURNING compiled once per dialect with positional parameters,
    run on the DBAPI cursor: SQLAlchemy's per-row result processing cost more than the
    delete itself (tens of thousands of rows a second at 16,384 ranks)."""
    got = _delete_sql.get(conn.dialect.name)
    if got is None:
        c = rank_steps.c
        stmt = (delete(rank_steps)
                .where(c.run_id == bindparam("run_id"), c.attempt == bindparam("attempt"),
                       c.step >= bindparam("step_from"), c.step < bindparam("step_to"),
                       c.rank >= bindparam("rank_from"), c.rank <= bindparam("rank_last"))
                .returning(*(c[k] for k in _DELETE_COLS)))
        dialect: Any = conn.dialect
        cdialect = dialect if dialect.positional else type(dialect)(paramstyle="format")
        compiled = stmt.compile(dialect=cdialect)
        got = _delete_sql[conn.dialect.name] = (compiled.string,
                                                tuple(compiled.positiontup or ()))
    return got


def roll_up(conn: Connection, *, run_id: int, attempt: int, step_from: int, step_to: int,
            bucket_steps: int, rank_from: int = 0, rank_last: int = 2**31 - 1) -> int:
    """Delete the run attempt's per-rank rows of steps ``step_from`` <= step < ``step_to``
    (of ranks ``rank_from`` <= rank <= ``rank_last``: a step of a big run is split), and merge
    what they said into their rank's rollup of each bucket (and rank 0's batch indexes into
    ``step_batches``); the number of rows deleted.  The summaries are built from the rows
    the DELETE returned, so they hold exactly what was deleted, also when an ingest commits
    a late row of these steps meanwhile (Postgres)."""
    sql, order = _delete_statement(conn)
    params = {"run_id": run_id, "attempt": attempt, "step_from": step_from, "step_to": step_to,
              "rank_from": rank_from, "rank_last": rank_last}
    # (the driver's connection, checked out for this transaction: never None here)
    cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        cur.execute(sql, tuple(params[k] for k in order))
        gone = cur.fetchall()
    finally:
        cur.close()
    if not gone:
        return 0
    groups: dict[tuple[int, int], list[Any]] = {}
    for r in gone:
        key = (r[0], r[1] - r[1] % bucket_steps)
        g = groups.get(key)
        if g is None:
            groups[key] = [r]
        else:
            g.append(r)
    rollups = []
    for (rank, start), rows in groups.items():
        _, steps, ts, _, data_s, compute_s, step_s, loss, special = zip(*rows, strict=True)
        d: dict[str, Any] = {
            "run_id": run_id, "attempt": attempt, "rank": rank, "bucket_start": start,
            "bucket_steps": bucket_steps, "rows": len(rows), "step_first": min(steps),
            "step_last": max(steps), "t_first": min(ts), "t_last": max(ts),
            "loss_nonfinite": len(special) - special.count(None)}
        for m, col in (("data_s", data_s), ("compute_s", compute_s), ("step_s", step_s),
                       ("loss", loss)):
            vals = [v for v in col if v is not None]
            d[f"{m}_n"] = len(vals)
            d[f"{m}_sum"] = sum(vals) if vals else None
            d[f"{m}_max"] = max(vals) if vals else None
            if m == "loss":
                d["loss_min"] = min(vals) if vals else None
        rollups.append(d)
    _merge_rollups(conn, rollups)
    batches = {r[1]: int(r[3]) for key, rows in groups.items() if key[0] == 0
               for r in rows if r[3] is not None}
    if batches:
        ins = insert(conn, step_batches)
        conn.execute(ins.on_conflict_do_nothing(index_elements=["run_id", "attempt", "step"]),
                     [{"run_id": run_id, "attempt": attempt, "step": st, "batch_index": b}
                      for st, b in sorted(batches.items())])
    return len(gone)


_merge_sql: dict[str, Any] = {}


def _merge_rollups(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Insert each rollup, or add it to the one already stored for its key."""
    stmt = _merge_sql.get(conn.dialect.name)
    if stmt is None:  # built once per dialect: building it costs more than running it
        ins = insert(conn, rank_rollups)
        t, ex = rank_rollups.c, ins.excluded
        merged: dict[str, Any] = {
            "rows": t.rows + ex.rows, "step_first": least(t.step_first, ex.step_first),
            "step_last": greatest(t.step_last, ex.step_last),
            "t_first": least(t.t_first, ex.t_first), "t_last": greatest(t.t_last, ex.t_last),
            "loss_nonfinite": t.loss_nonfinite + ex.loss_nonfinite,
        }
        fold = {"sum": nsum, "min": least, "max": greatest}
        for m, ks in _MEASURES.items():
            merged[f"{m}_n"] = t[f"{m}_n"] + ex[f"{m}_n"]
            for k in ks:
                merged[f"{m}_{k}"] = fold[k](t[f"{m}_{k}"], ex[f"{m}_{k}"])
        stmt = _merge_sql[conn.dialect.name] = ins.on_conflict_do_update(
            index_elements=list(_KEY), set_=merged)
    conn.execute(stmt, rows)


def rollups(conn: Connection, *, run_id: int, attempt: int | None = None,
            rank: int | None = None, limit: int = 10_000) -> list[dict[str, Any]]:
    """The run's rollups (of one attempt, one rank), in (attempt, bucket, rank) order, each
    with the means of its measures (``*_mean``: None without a value)."""
    c = rank_rollups.c
    q = select(rank_rollups).where(c.run_id == run_id)
    if attempt is not None:
        q = q.where(c.attempt == attempt)
    if rank is not None:
        q = q.where(c.rank == rank)
    q = q.order_by(c.attempt, c.bucket_start, c.rank).limit(limit)
    out = []
    for r in conn.execute(q):
        d = dict(r._mapping)
        for m in _MEASURES:
            d[f"{m}_mean"] = d[f"{m}_sum"] / d[f"{m}_n"] if d[f"{m}_n"] else None
        out.append(d)
    return out


def kept_from_step(conn: Connection, *, run_id: int, attempt: int) -> int | None:
    """The oldest step of the attempt whose per-rank rows are still kept (None: none kept)."""
    c = rank_steps.c
    v = conn.execute(select(func.min(c.step)).where(c.run_id == run_id,
                                                    c.attempt == attempt)).scalar_one()
    return None if v is None else int(v)


def rolled_up_steps(conn: Connection, *, run_id: int, attempt: int) -> tuple[int, int] | None:
    """(first, last) step of the attempt whose per-rank rows were rolled up, None if none."""
    c = rank_rollups.c
    lo, hi = conn.execute(select(func.min(c.step_first), func.max(c.step_last))
                          .where(c.run_id == run_id, c.attempt == attempt)).one()
    return None if lo is None else (int(lo), int(hi))


def agents_after(conn: Connection, *, after_id: int, limit: int) -> list[int]:
    """Ids of up to ``limit`` agents after ``after_id``, in id order."""
    q = select(agents.c.id).where(agents.c.id > after_id).order_by(agents.c.id).limit(limit)
    return [int(r[0]) for r in conn.execute(q)]


def prune_batch_keys(conn: Connection, *, agent_ids: list[int], keep: int) -> int:
    """Delete each agent's stored-batch keys but its newest ``keep`` sequence numbers (the
    newest stays: the agent's next seq follows it); the keys deleted.  Each agent is two
    lookups in the (agent_id, seq) key."""
    ib = ingested_batches.c
    top = (select(func.max(ib.seq)).where(ib.agent_id == bindparam("aid"))
           .scalar_subquery())
    # one statement per agent, compiled once
    stmt = delete(ingested_batches).where(ib.agent_id == bindparam("aid"), ib.seq <= top - keep)
    gone = 0
    for aid in agent_ids:
        gone += int(conn.execute(stmt, {"aid": aid}).rowcount or 0)
    return gone

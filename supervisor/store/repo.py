"""Every SQL statement of the supervisor.  Keyword-only functions taking a ``Connection``.

The ingest path (``ingest_batch``) is written for throughput: one transaction per batch (the
caller's), multi-row VALUES statements run on the DBAPI cursor, rows pre-reduced in Python so
each upsert touches a key once, and the contended per-step aggregate upsert placed last so its
row lock (Postgres) is held only until the commit.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    ColumnElement,
    Connection,
    Select,
    String,
    Table,
    and_,
    bindparam,
    case,
    func,
    literal,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from supervisor import wire
from supervisor.store.tables import (
    actions,
    agents,
    checkpoints,
    commands,
    events,
    exits,
    incidents,
    ingested_batches,
    rank_steps,
    ranks,
    runs,
    step_aggregates,
)

# ---------------------------------------------------------------------------------------------
# helpers


def _insert(conn: Connection, table: Table) -> Any:
    """Dialect insert (both SQLite and Postgres support ON CONFLICT)."""
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def split_float(x: float | None) -> tuple[float | None, str | None]:
    """A float as (finite value or None, "nan"/"inf"/"-inf" or None): SQLite drops NaN."""
    if x is None or math.isfinite(x):
        return x, None
    if math.isnan(x):
        return None, "nan"
    return None, "inf" if x > 0 else "-inf"


def join_float(value: float | None, special: str | None) -> float | None:
    if special is None:
        return value
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}[special]


def _least(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
    # Portable NULL-ignoring min of two values (SQLite's min(a, b) is NULL if either is).
    return case((a.is_(None), b), (b.is_(None), a), (a <= b, a), else_=b)


def _greatest(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((a.is_(None), b), (b.is_(None), a), (a >= b, a), else_=b)


def _nsum(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((a.is_(None), b), (b.is_(None), a), else_=a + b)


def _row(r: Any) -> dict[str, Any]:
    return dict(r._mapping)


# ---------------------------------------------------------------------------------------------
# runs and agents


def register_agent(
    conn: Connection, *, req: wire.RegisterRequest, now: float
) -> dict[str, Any]:
    """Create the run and the agent if new (an agent re-registering keeps its id).

    Returns ``{agent_id, run_id, attempt, next_seq}``."""
    ins = _insert(conn, runs).values(
        name=req.run, status="running", attempt=0, restarts=0, reason="",
        created_at=now, updated_at=now,
    )
    conn.execute(ins.on_conflict_do_nothing(index_elements=["name"]))
    run = conn.execute(
        select(runs.c.id, runs.c.attempt).where(runs.c.name == req.run)
    ).one()
    values = {
        "hostname": req.hostname, "pid": req.pid, "command": list(req.command),
        "nproc_per_node": req.nproc_per_node, "checkpoint_root": req.checkpoint_root,
        "agent_version": req.agent_version, "last_seen_at": now, "state": "registered",
    }
    ins = _insert(conn, agents).values(
        run_id=run.id, node=req.node, registered_at=now, dropped=0, **values
    )
    conn.execute(ins.on_conflict_do_update(index_elements=["run_id", "node"], set_=values))
    agent_id = conn.execute(
        select(agents.c.id).where(agents.c.run_id == run.id, agents.c.node == req.node)
    ).scalar_one()
    max_seq = conn.execute(
        select(func.max(ingested_batches.c.seq)).where(ingested_batches.c.agent_id == agent_id)
    ).scalar_one()
    return {
        "agent_id": agent_id,
        "run_id": run.id,
        "attempt": run.attempt,
        "next_seq": 0 if max_seq is None else int(max_seq) + 1,
    }


def get_run_by_name(conn: Connection, *, name: str) -> dict[str, Any] | None:
    r = conn.execute(select(runs).where(runs.c.name == name)).first()
    return _row(r) if r else None


def get_run(conn: Connection, *, run_id: int) -> dict[str, Any]:
    return _row(conn.execute(select(runs).where(runs.c.id == run_id)).one())


def list_runs(conn: Connection) -> list[dict[str, Any]]:
    return [_row(r) for r in conn.execute(select(runs).order_by(runs.c.id))]


def run_agents(conn: Connection, *, run_id: int) -> list[dict[str, Any]]:
    q = select(agents).where(agents.c.run_id == run_id).order_by(agents.c.id)
    return [_row(r) for r in conn.execute(q)]


def agent_liveness(conn: Connection, *, run_id: int) -> list[dict[str, Any]]:
    """What the detectors need of each agent (no JSON health columns: read every tick)."""
    a = agents.c
    q = (select(a.id, a.node, a.state, a.last_seen_at, a.disk_free_bytes, a.disk_total_bytes)
         .where(a.run_id == run_id).order_by(a.id))
    return [{"id": i, "node": n, "state": st, "last_seen_at": t, "disk_free_bytes": f,
             "disk_total_bytes": tot} for i, n, st, t, f, tot in conn.execute(q)]


def set_run_status(
    conn: Connection,
    *,
    run_id: int,
    status: str,
    now: float,
    reason: str | None = None,
    attempt: int | None = None,
    restarts: int | None = None,
) -> None:
    values: dict[str, Any] = {"status": status, "updated_at": now}
    if reason is not None:
        values["reason"] = reason
    if attempt is not None:
        values["attempt"] = attempt
    if restarts is not None:
        values["restarts"] = restarts
    conn.execute(update(runs).where(runs.c.id == run_id).values(**values))


def latest_step(conn: Connection, *, run_id: int, attempt: int) -> dict[str, Any] | None:
    """The newest step aggregate of one attempt (None before its first step report)."""
    q = (
        select(step_aggregates)
        .where(step_aggregates.c.run_id == run_id, step_aggregates.c.attempt == attempt)
        .order_by(step_aggregates.c.step.desc())
        .limit(1)
    )
    r = conn.execute(q).first()
    return _row(r) if r else None


def first_step(conn: Connection, *, run_id: int, attempt: int) -> int | None:
    q = select(func.min(step_aggregates.c.step)).where(
        step_aggregates.c.run_id == run_id, step_aggregates.c.attempt == attempt
    )
    v = conn.execute(q).scalar_one()
    return None if v is None else int(v)


def _delivered_step(run_id: int, attempt: int) -> Select[Any]:
    # Each rank's newest step of the attempt is in ``ranks`` (one row per rank).
    return select(func.min(ranks.c.step)).where(ranks.c.run_id == run_id,
                                                ranks.c.attempt == attempt)


def delivered_step(conn: Connection, *, run_id: int, attempt: int) -> int | None:
    """The newest step of ``attempt`` that every rank reporting in it has delivered (None
    before any).  Ranks report through their own agents and batches, so the steps after it
    hold some ranks only: a figure over ranks (throughput, straggler scores) ends here."""
    v = conn.execute(_delivered_step(run_id, attempt)).scalar_one()
    return None if v is None else int(v)


def throughput(
    conn: Connection, *, run_id: int, attempt: int, window: int = 20
) -> dict[str, float | None]:
    """Steps, samples and tokens per second over the newest ``window`` steps of an attempt up
    to ``delivered_step`` (the steps after it hold some ranks' samples only, which would read
    as a drop in throughput), and ``ranks``: the most ranks that reported one of those
    steps."""
    a = step_aggregates.c
    delivered = _delivered_step(run_id, attempt).scalar_subquery()
    q = (
        select(a.samples, a.tokens, a.t_last, a.ranks)
        .where(a.run_id == run_id, a.attempt == attempt,
               or_(delivered.is_(None), a.step <= delivered))
        .order_by(a.step.desc())
        .limit(window)
    )
    rows = conn.execute(q).all()
    out: dict[str, float | None] = {"steps_per_s": None, "samples_per_s": None,
                                    "tokens_per_s": None,
                                    "ranks": max((r.ranks for r in rows), default=None)}
    if len(rows) < 2:
        return out
    span = rows[0].t_last - rows[-1].t_last
    if span <= 0:
        return out
    newer = rows[:-1]  # the oldest row only marks the start of the span
    out["steps_per_s"] = len(newer) / span
    out["samples_per_s"] = sum(r.samples for r in newer) / span
    out["tokens_per_s"] = sum(r.tokens for r in newer) / span
    return out


# ---------------------------------------------------------------------------------------------
# ingest


@dataclass
class IngestResult:
    run_id: int
    attempt: int
    duplicate: bool
    commands: list[dict[str, Any]]
    protect: list[str] = field(default_factory=list)  # checkpoint paths to keep


class UnknownAgent(LookupError):
    pass


def ingest_batch(conn: Connection, *, batch: wire.IngestBatch, now: float) -> IngestResult:
    """Store one batch in the caller's transaction (see ``ingest_batches``).

    Raises ``UnknownAgent`` when the agent id was never registered."""
    res = ingest_batches(conn, batches=[batch], now=now)[0]
    if isinstance(res, UnknownAgent):
        raise res
    return res


def ingest_batches(
    conn: Connection, *, batches: Sequence[wire.IngestBatch], now: float
) -> list[IngestResult | UnknownAgent]:
    """Store a group of batches in the caller's ONE transaction; results in input order.

    A replayed (agent_id, seq), stored before or earlier in the same group, stores nothing and
    is answered as a duplicate.  A batch of an unregistered agent gets ``UnknownAgent`` and
    stores nothing.  Rows of all batches go in one multi-row statement per table, and the
    per-step aggregates are merged across the group first: the cost per batch falls as the
    load rises (the ingest writer groups whatever arrived while the last group was written).
    """
    hot = _hot(conn)
    ids = sorted({b.agent_id for b in batches})
    cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        return _ingest_group(conn, hot, cur, batches, ids, now)
    finally:
        cur.close()


def _ingest_group(conn: Connection, hot: _HotSQL, cur: Any,
                  batches: Sequence[wire.IngestBatch], ids: list[int], now: float
                  ) -> list[IngestResult | UnknownAgent]:
    # agent id -> (run id, the run's attempt, its protected checkpoints)
    heads: dict[int, tuple[int, int, list[str]]]
    if len(ids) == 1:  # the common case on SQLite: the raw single-agent statement
        r = hot.fetchone(cur, "head", {"agent_id": ids[0]})
        heads = {ids[0]: (int(r[0]), int(r[1]), _json_list(r[2]))} if r else {}
    else:
        heads = {int(r[0]): (int(r[1]), int(r[2]), _json_list(r[3]))
                 for r in conn.execute(_HEADS, {"ids": ids})}
    # Claim each (agent_id, seq) once; RETURNING, not rowcount, says which ones were new.
    wanted: dict[tuple[int, int], dict[str, Any]] = {}
    for b in batches:
        if b.agent_id in heads and (b.agent_id, b.seq) not in wanted:
            wanted[(b.agent_id, b.seq)] = {"agent_id": b.agent_id, "seq": b.seq,
                                           "received_at": now, "items": len(b.items)}
    claimed = {(int(r[0]), int(r[1]))
               for r in hot.insert_rows(cur, "claim", list(wanted.values()), fetch=True)}
    acc = _Acc()
    duplicate: list[bool] = []
    for b in batches:
        key = (b.agent_id, b.seq)
        new = key in claimed
        claimed.discard(key)  # a second copy in this group is a duplicate
        duplicate.append(not new)
        if new:
            _collect(acc, b, run_id=heads[b.agent_id][0], now=now)
    aggs = _flush(conn, hot, cur, acc, now=now)
    # After this group's acknowledgements, so an acknowledged command is not re-sent.
    pending = _pending(conn, hot, cur, list(heads), now)
    if aggs:
        # Last, right before the commit: every agent of a run updates the same step row,
        # and Postgres holds that row lock until the commit.  Sorted keys: concurrent
        # writers lock rows in the same order (no deadlock).
        hot.insert_rows(cur, "aggregates", aggs)
    out: list[IngestResult | UnknownAgent] = []
    for b, dup in zip(batches, duplicate, strict=True):
        if b.agent_id not in heads:
            out.append(UnknownAgent(b.agent_id))
            continue
        run_id, attempt, protect = heads[b.agent_id]
        out.append(IngestResult(run_id=run_id, attempt=attempt, duplicate=dup,
                                commands=pending.get(b.agent_id, []), protect=protect))
    return out


def _json_list(raw: Any) -> list[str]:
    """A JSON list column read on the raw cursor (text on SQLite, decoded on Postgres)."""
    if isinstance(raw, str | bytes):
        raw = json.loads(raw)
    return [str(x) for x in raw] if isinstance(raw, list) else []


def _pending(conn: Connection, hot: _HotSQL, cur: Any, agent_ids: list[int], now: float
             ) -> dict[int, list[dict[str, Any]]]:
    if len(agent_ids) != 1:
        return pending_commands_for(conn, agent_ids=agent_ids, now=now)
    rows = [
        {"id": r[0], "kind": r[1], "attempt": r[2],
         "plan": json.loads(r[3]) if isinstance(r[3], str | bytes) else r[3],
         "not_before": r[4], "reason": r[5], "collect_stacks": bool(r[6])}
        for r in hot.fetchall(cur, "pending", {"agent_id": agent_ids[0]})
    ]
    if rows:
        _mark_sent(conn, ids=[c["id"] for c in rows], now=now)
    return {agent_ids[0]: rows} if rows else {}


# Statement size limits: SQLite allows 32766 parameters (since 3.32), Postgres 65535.
MAX_PARAMS = 30_000
MAX_ROWS_PER_STATEMENT = 1000

# Column order of the hot-path rows (the raw statements bind by these names).
STEP_KEYS = ("run_id", "attempt", "step", "rank", "t", "batch_index", "data_s", "compute_s",
             "step_s", "loss", "loss_special", "grad_norm", "grad_norm_special", "lr")
RANK_KEYS = ("run_id", "rank", "agent_id", "local_rank", "pid", "attempt", "step", "t",
             "data_s", "compute_s", "step_s", "loss", "loss_special", "grad_norm",
             "grad_norm_special")
AGG_KEYS = ("run_id", "attempt", "step", "ranks", "loss_sum", "loss_count", "loss_min",
            "loss_max", "loss_nonfinite", "grad_norm_nonfinite", "samples", "tokens",
            "step_s_max", "t_first", "t_last")


class _HotSQL:
    """The ingest statements, compiled once per dialect and run on the DBAPI cursor.

    Why: at hundreds of batches per second, SQLAlchemy's per-execute bookkeeping costs more
    than SQLite's own work, and on Postgres each statement is a round trip.  The statements
    are still built with SQLAlchemy (one dialect-correct source); they are compiled with
    positional parameters, and a batch's rows go in ONE multi-row ``VALUES`` statement
    (the single-row group repeated), not an executemany."""

    def __init__(self, dialect: Any) -> None:
        # Positional parameters on every backend (psycopg: "format" style, %s), so that a
        # VALUES group can be repeated for several rows.
        cdialect = dialect if dialect.positional else type(dialect)(paramstyle="format")
        ins = postgresql.insert if dialect.name == "postgresql" else sqlite.insert
        stmts: dict[str, tuple[Any, Sequence[str] | None]] = {
            "head": (
                select(agents.c.run_id, runs.c.attempt, runs.c.protected)
                .join(runs, runs.c.id == agents.c.run_id)
                .where(agents.c.id == bindparam("agent_id")),
                None,
            ),
            "claim": (
                ins(ingested_batches)
                .on_conflict_do_nothing(index_elements=["agent_id", "seq"])
                .returning(ingested_batches.c.agent_id, ingested_batches.c.seq),
                ("agent_id", "seq", "received_at", "items"),
            ),
            "agent_seen": (_AGENT_SEEN, None),
            "pending": (_PENDING_ONE, None),
            "rank_steps": (rank_steps.insert(), STEP_KEYS),
            "ranks": (_ranks_upsert(dialect.name), RANK_KEYS),
            "aggregates": (_aggregates_upsert(dialect.name), AGG_KEYS),
        }
        self.sql: dict[str, tuple[str, tuple[str, ...]]] = {}
        for name, (stmt, keys) in stmts.items():
            c = stmt.compile(dialect=cdialect, column_keys=list(keys) if keys else None)
            self.sql[name] = (c.string, tuple(c.positiontup or ()))
        self._multi: dict[tuple[str, int], str] = {}

    def execute(self, cur: Any, name: str, row: dict[str, Any]) -> None:
        sql, order = self.sql[name]
        cur.execute(sql, tuple(row[k] for k in order))

    def executemany(self, cur: Any, name: str, rows: list[dict[str, Any]]) -> None:
        sql, order = self.sql[name]
        cur.executemany(sql, [tuple(row[k] for k in order) for row in rows])

    def insert_rows(self, cur: Any, name: str, rows: list[dict[str, Any]], *,
                    fetch: bool = False) -> list[Any]:
        """Rows in multi-row statements (keys must be unique for an upsert); with ``fetch``,
        the RETURNING rows."""
        sql, order = self.sql[name]
        per = max(1, min(MAX_ROWS_PER_STATEMENT, MAX_PARAMS // max(1, len(order))))
        out: list[Any] = []
        for i in range(0, len(rows), per):
            chunk = rows[i:i + per]
            key = (name, len(chunk))
            multi = self._multi.get(key)
            if multi is None:
                multi = self._multi[key] = _repeat_values(sql, len(chunk))
            cur.execute(multi, tuple(row[k] for row in chunk for k in order))
            if fetch:
                out.extend(cur.fetchall())
        return out

    def fetchone(self, cur: Any, name: str, row: dict[str, Any]) -> Any:
        self.execute(cur, name, row)
        return cur.fetchone()

    def fetchall(self, cur: Any, name: str, row: dict[str, Any]) -> list[Any]:
        self.execute(cur, name, row)
        return list(cur.fetchall())


def _repeat_values(sql: str, n: int) -> str:
    """``INSERT ... VALUES (a, b) ON CONFLICT ...`` with the VALUES group repeated n times."""
    i = sql.index(" VALUES (") + len(" VALUES ")
    depth = 0
    for j in range(i, len(sql)):
        depth += {"(": 1, ")": -1}.get(sql[j], 0)
        if depth == 0:
            group = sql[i:j + 1]
            return sql[:i] + ", ".join([group] * n) + sql[j + 1:]
    raise ValueError(f"no VALUES group in {sql[:80]!r}")


_hot_cache: dict[tuple[str, str], _HotSQL] = {}


def _hot(conn: Connection) -> _HotSQL:
    key = (conn.dialect.name, conn.dialect.driver)
    h = _hot_cache.get(key)
    if h is None:
        h = _hot_cache[key] = _HotSQL(conn.dialect)
    return h


@dataclass
class _Acc:
    """Rows of a group of batches, merged where a key repeats."""

    step_rows: list[dict[str, Any]] = field(default_factory=list)
    latest_rank: dict[tuple[int, int], dict[str, Any]] = field(default_factory=dict)
    aggs: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    seen: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)
    results: list[tuple[int, int, wire.CommandResultItem, float]] = field(default_factory=list)


def _collect(acc: _Acc, batch: wire.IngestBatch, *, run_id: int, now: float) -> None:
    agent_id = batch.agent_id
    t0 = batch.sent_at if batch.sent_at is not None else now
    heartbeat: wire.HeartbeatItem | None = None
    for it in batch.items:
        if isinstance(it, wire.StepItem):
            attempt = it.attempt if it.attempt is not None else batch.attempt
            t = it.t if it.t is not None else t0
            loss, loss_sp = split_float(it.loss)
            gn, gn_sp = split_float(it.grad_norm)
            row = {
                "run_id": run_id, "attempt": attempt, "step": it.step, "rank": it.rank, "t": t,
                "batch_index": it.batch_index, "data_s": _finite(it.data_s),
                "compute_s": _finite(it.compute_s), "step_s": _finite(it.step_s),
                "loss": loss, "loss_special": loss_sp, "grad_norm": gn,
                "grad_norm_special": gn_sp, "lr": _finite(it.lr),
            }
            acc.step_rows.append(row)
            prev = acc.latest_rank.get((run_id, it.rank))
            if prev is None or (attempt, it.step) >= (prev["attempt"], prev["step"]):
                acc.latest_rank[(run_id, it.rank)] = {
                    "run_id": run_id, "rank": it.rank, "agent_id": agent_id,
                    "local_rank": it.local_rank, "pid": it.pid, "attempt": attempt,
                    "step": it.step, "t": t, "data_s": row["data_s"],
                    "compute_s": row["compute_s"], "step_s": row["step_s"], "loss": loss,
                    "loss_special": loss_sp, "grad_norm": gn, "grad_norm_special": gn_sp,
                }
            _merge_agg(acc.aggs, run_id, attempt, it, row)
        elif isinstance(it, wire.EventItem):
            acc.events.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "rank": it.rank, "t": it.t if it.t is not None else t0, "name": it.name,
                "step": it.step, "message": it.message, "details": _json_safe(it.details),
            })
        elif isinstance(it, wire.CheckpointItem):
            acc.checkpoints.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "step": it.step, "path": it.path, "bytes": it.bytes, "lineage": it.lineage,
                "complete": it.complete, "save_s": _finite(it.save_s),
                "async_save": it.async_save, "t": it.t if it.t is not None else t0,
            })
        elif isinstance(it, wire.HeartbeatItem):
            heartbeat = it
        elif isinstance(it, wire.ExitItem):
            acc.exits.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "t": it.t if it.t is not None else t0, "exit_code": it.exit_code,
                "signal": it.signal, "outcome": it.outcome,
                "failed_ranks": _json_safe(it.failed_ranks), "handled": False, "verdict": None,
            })
        else:
            acc.results.append((agent_id, run_id, it, it.t if it.t is not None else t0))
    acc.seen.append({
        "agent_id": agent_id, "now": now, "dropped": batch.dropped, "attempt": batch.attempt,
        "state": heartbeat.state if heartbeat else None,
        "disk": heartbeat.disk_free_bytes if heartbeat else None,
        "disk_total": heartbeat.disk_total_bytes if heartbeat else None,
        # JSON text for the raw statement (a cast to JSON on Postgres); None keeps the last.
        "workers": _worker_stats(heartbeat.workers) if heartbeat else None,
        "gpus": (json.dumps(_json_safe(heartbeat.gpus), separators=(",", ":"))
                 if heartbeat and heartbeat.gpus is not None else None),
    })


_WORKER_KEYS = ("rank", "local_rank", "pid", "cpu_percent", "rss_bytes")


def _worker_stats(workers: list[dict[str, Any]]) -> str:
    """The heartbeat's worker list as stored: the known keys with finite numbers only."""
    rows = [{k: w[k] for k in _WORKER_KEYS
             if isinstance(w.get(k), int | float) and not isinstance(w.get(k), bool)
             and math.isfinite(w[k])}
            for w in workers]
    return json.dumps(rows, separators=(",", ":"))


def _flush(conn: Connection, hot: _HotSQL, cur: Any, acc: _Acc, *, now: float
           ) -> list[dict[str, Any]]:
    """Write the collected rows; returns the step-aggregate rows for the caller to upsert."""
    if acc.seen:
        hot.executemany(cur, "agent_seen", acc.seen)
    if acc.step_rows:
        hot.insert_rows(cur, "rank_steps", acc.step_rows)
    # Rare items: plain Core statements.
    if acc.events:
        conn.execute(events.insert(), acc.events)
    if acc.checkpoints:
        conn.execute(checkpoints.insert(), acc.checkpoints)
    if acc.exits:
        conn.execute(exits.insert(), acc.exits)
    for agent_id, run_id, res, t in acc.results:
        _apply_command_result(conn, agent_id=agent_id, run_id=run_id, item=res, now=now, t=t)
    if acc.latest_rank:
        hot.insert_rows(cur, "ranks", [acc.latest_rank[k] for k in sorted(acc.latest_rank)])
    return [acc.aggs[k] for k in sorted(acc.aggs)]


# Built once: statement construction costs more than execution on the hot path.
_AGENT_SEEN = (
    update(agents)
    .where(agents.c.id == bindparam("agent_id"))
    .values(
        last_seen_at=bindparam("now"),
        dropped=bindparam("dropped"),
        attempt=bindparam("attempt"),
        state=func.coalesce(bindparam("state", type_=String), agents.c.state),
        disk_free_bytes=func.coalesce(bindparam("disk", type_=BigInteger),
                                      agents.c.disk_free_bytes),
        disk_total_bytes=func.coalesce(bindparam("disk_total", type_=BigInteger),
                                       agents.c.disk_total_bytes),
        workers=func.coalesce(bindparam("workers", type_=JSON), agents.c.workers),
        gpus=func.coalesce(bindparam("gpus", type_=JSON), agents.c.gpus),
    )
)



_PENDING_ONE = (
    select(commands.c.id, commands.c.kind, commands.c.attempt, commands.c.plan,
           commands.c.not_before, commands.c.reason, commands.c.collect_stacks)
    # A literal, not a bound value: the raw statement binds only the names it is given.
    .where(commands.c.agent_id == bindparam("agent_id"),
           commands.c.status == literal_column("'pending'"))
    .order_by(commands.c.id)
)
_HEADS = (
    select(agents.c.id, agents.c.run_id, runs.c.attempt, runs.c.protected)
    .join(runs, runs.c.id == agents.c.run_id)
    .where(agents.c.id.in_(bindparam("ids", expanding=True)))
)
_PENDING_MANY = (
    select(commands.c.agent_id, commands.c.id, commands.c.kind, commands.c.attempt,
           commands.c.plan, commands.c.not_before, commands.c.reason,
           commands.c.collect_stacks)
    .where(commands.c.agent_id.in_(bindparam("ids", expanding=True)),
           commands.c.status == literal_column("'pending'"))
    .order_by(commands.c.id)
)


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def _json_safe(obj: Any) -> Any:
    """JSON columns cannot hold NaN on every backend: non-finite floats become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def _merge_agg(
    aggs: dict[tuple[int, int, int], dict[str, Any]],
    run_id: int,
    attempt: int,
    it: wire.StepItem,
    row: dict[str, Any],
) -> None:
    key = (run_id, attempt, it.step)
    a = aggs.get(key)
    if a is None:
        a = aggs[key] = {
            "run_id": run_id, "attempt": attempt, "step": it.step, "ranks": 0,
            "loss_sum": None, "loss_count": 0, "loss_min": None, "loss_max": None,
            "loss_nonfinite": 0, "grad_norm_nonfinite": 0, "samples": 0, "tokens": 0,
            "step_s_max": None, "t_first": row["t"], "t_last": row["t"],
        }
    a["ranks"] += 1
    loss = row["loss"]
    if loss is not None:
        a["loss_sum"] = loss if a["loss_sum"] is None else a["loss_sum"] + loss
        a["loss_count"] += 1
        a["loss_min"] = loss if a["loss_min"] is None else min(a["loss_min"], loss)
        a["loss_max"] = loss if a["loss_max"] is None else max(a["loss_max"], loss)
    if row["loss_special"] is not None:
        a["loss_nonfinite"] += 1
    if row["grad_norm_special"] is not None:
        a["grad_norm_nonfinite"] += 1
    a["samples"] += it.samples or 0
    a["tokens"] += it.tokens or 0
    s = row["step_s"]
    if s is not None and (a["step_s_max"] is None or s > a["step_s_max"]):
        a["step_s_max"] = s
    a["t_first"] = min(a["t_first"], row["t"])
    a["t_last"] = max(a["t_last"], row["t"])


@functools.cache
def _ranks_upsert(dialect: str) -> Any:
    # Built once per dialect: constructing an upsert costs more than executing it.
    ins = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(ranks)
    ex = ins.excluded
    newer = or_(
        ex.attempt > ranks.c.attempt,
        and_(ex.attempt == ranks.c.attempt, ex.step >= ranks.c.step),
    )
    cols = [c.name for c in ranks.columns if c.name not in ("run_id", "rank")]
    return ins.on_conflict_do_update(
        index_elements=["run_id", "rank"], set_={c: ex[c] for c in cols}, where=newer
    )


@functools.cache
def _aggregates_upsert(dialect: str) -> Any:
    ins = (postgresql.insert if dialect == "postgresql" else sqlite.insert)(step_aggregates)
    ex, c = ins.excluded, step_aggregates.c
    return ins.on_conflict_do_update(
        index_elements=["run_id", "attempt", "step"],
        set_={
            "ranks": c.ranks + ex.ranks,
            "loss_sum": _nsum(c.loss_sum, ex.loss_sum),
            "loss_count": c.loss_count + ex.loss_count,
            "loss_min": _least(c.loss_min, ex.loss_min),
            "loss_max": _greatest(c.loss_max, ex.loss_max),
            "loss_nonfinite": c.loss_nonfinite + ex.loss_nonfinite,
            "grad_norm_nonfinite": c.grad_norm_nonfinite + ex.grad_norm_nonfinite,
            "samples": c.samples + ex.samples,
            "tokens": c.tokens + ex.tokens,
            "step_s_max": _greatest(c.step_s_max, ex.step_s_max),
            "t_first": _least(c.t_first, ex.t_first),
            "t_last": _greatest(c.t_last, ex.t_last),
        },
    )


def _apply_command_result(
    conn: Connection,
    *,
    agent_id: int,
    run_id: int,
    item: wire.CommandResultItem,
    now: float,
    t: float,
) -> None:
    # Only the agent's own commands; "done"/"failed" are final, a late "delivered" after them
    # must not move the status back.
    cond = [commands.c.id == item.command_id, commands.c.agent_id == agent_id]
    if item.status == "delivered":
        cond.append(commands.c.status == "pending")
    res = conn.execute(
        update(commands).where(*cond).values(status=item.status, detail=item.detail,
                                             updated_at=now)
    )
    if res.rowcount == 0:
        known = conn.execute(
            select(commands.c.id).where(
                commands.c.id == item.command_id, commands.c.agent_id == agent_id
            )
        ).first()
        if known is None:
            # Not this agent's command: keep a trace, store nothing else.
            conn.execute(events.insert().values(
                run_id=run_id, agent_id=agent_id, attempt=0, rank=None, t=t,
                name="unknown_command_result", step=None,
                message=f"command_result for command {item.command_id} not sent to this agent",
                details={"status": item.status, "detail": item.detail},
            ))


def _mark_sent(conn: Connection, *, ids: list[int], now: float) -> None:
    conn.execute(
        update(commands)
        .where(commands.c.id.in_(ids))
        .values(sent_count=commands.c.sent_count + 1, updated_at=now)
    )


def pending_commands_for(
    conn: Connection, *, agent_ids: Sequence[int], now: float
) -> dict[int, list[dict[str, Any]]]:
    """Unacknowledged commands of several agents (re-sent with every reply), by agent."""
    if not agent_ids:
        return {}
    out: dict[int, list[dict[str, Any]]] = {}
    for r in conn.execute(_PENDING_MANY, {"ids": list(agent_ids)}):
        d = _row(r)
        out.setdefault(int(d.pop("agent_id")), []).append(d)
    if out:
        _mark_sent(conn, ids=[c["id"] for cs in out.values() for c in cs], now=now)
    return out


def pending_commands(conn: Connection, *, agent_id: int, now: float) -> list[dict[str, Any]]:
    """Commands one agent has not acknowledged yet (re-sent with every reply)."""
    return pending_commands_for(conn, agent_ids=[agent_id], now=now).get(agent_id, [])


# ---------------------------------------------------------------------------------------------
# evaluator / policy support


def unhandled_exits(conn: Connection) -> list[dict[str, Any]]:
    q = (
        select(exits, agents.c.node)
        .join(agents, agents.c.id == exits.c.agent_id)
        .where(exits.c.handled.is_(False))
        .order_by(exits.c.id)
    )
    return [_row(r) for r in conn.execute(q)]


def mark_exit(conn: Connection, *, exit_id: int, verdict: str) -> None:
    conn.execute(update(exits).where(exits.c.id == exit_id).values(handled=True, verdict=verdict))


def completed_agents(conn: Connection, *, run_id: int, attempt: int) -> set[int]:
    q = select(exits.c.agent_id).where(
        exits.c.run_id == run_id, exits.c.attempt == attempt, exits.c.outcome == "completed"
    )
    return {int(r[0]) for r in conn.execute(q)}


def newest_complete_checkpoint(conn: Connection, *, run_id: int) -> dict[str, Any] | None:
    """The newest complete checkpoint of the current lineage (never an abandoned one)."""
    q = (
        select(checkpoints)
        .where(checkpoints.c.run_id == run_id, checkpoints.c.complete.is_(True),
               checkpoints.c.abandoned.is_(False))
        .order_by(checkpoints.c.t.desc(), checkpoints.c.id.desc())
        .limit(1)
    )
    r = conn.execute(q).first()
    return _row(r) if r else None


def open_incident(conn: Connection, **values: Any) -> int:
    values.setdefault("status", "open")
    values.setdefault("details", {})
    return int(conn.execute(
        incidents.insert().values(**values).returning(incidents.c.id)
    ).scalar_one())


def resolve_incidents(conn: Connection, *, run_id: int, now: float) -> None:
    conn.execute(
        update(incidents)
        .where(incidents.c.run_id == run_id, incidents.c.status == "open")
        .values(status="resolved", resolved_at=now)
    )


def create_action(conn: Connection, **values: Any) -> int:
    values.setdefault("progress", {"queued": values["created_at"]})
    values.setdefault("updated_at", values["created_at"])
    return int(conn.execute(
        actions.insert().values(**values).returning(actions.c.id)
    ).scalar_one())


def update_action(conn: Connection, *, action_id: int, **values: Any) -> None:
    conn.execute(update(actions).where(actions.c.id == action_id).values(**values))


def create_commands(conn: Connection, *, rows: Sequence[dict[str, Any]]) -> None:
    if rows:
        conn.execute(commands.insert(), list(rows))


def supersede_commands(conn: Connection, *, run_id: int, now: float) -> None:
    """Unacknowledged commands of a run are dropped when a newer decision replaces them."""
    conn.execute(
        update(commands)
        .where(commands.c.run_id == run_id, commands.c.status == "pending")
        .values(status="superseded", updated_at=now)
    )


def actions_in_progress(conn: Connection) -> list[dict[str, Any]]:
    q = select(actions).where(actions.c.status.in_(("queued", "delivered", "restarted")))
    return [_row(r) for r in conn.execute(q.order_by(actions.c.id))]


def action_command_statuses(conn: Connection, *, action_id: int) -> list[str]:
    q = select(commands.c.status).where(commands.c.action_id == action_id)
    return [r[0] for r in conn.execute(q)]


# ---------------------------------------------------------------------------------------------
# detection support: windows of measurements for the detectors


def active_runs(conn: Connection) -> list[dict[str, Any]]:
    q = select(runs).where(runs.c.status.in_(("running", "restarting"))).order_by(runs.c.id)
    return [_row(r) for r in conn.execute(q)]


def step_times(conn: Connection, *, run_id: int, attempt: int, limit: int
               ) -> list[tuple[int, float]]:
    """(step, end time) of the newest ``limit`` step aggregates of an attempt, oldest first."""
    a = step_aggregates.c
    q = (select(a.step, a.t_last).where(a.run_id == run_id, a.attempt == attempt)
         .order_by(a.step.desc()).limit(limit))
    return [(int(r[0]), float(r[1])) for r in reversed(conn.execute(q).all())]


def count_steps(conn: Connection, *, run_id: int, attempt: int) -> int:
    a = step_aggregates.c
    q = select(func.count()).where(a.run_id == run_id, a.attempt == attempt)
    return int(conn.execute(q).scalar_one())


def rank_progress(conn: Connection, *, run_id: int, attempt: int
                  ) -> list[dict[str, Any]]:
    """Each rank's newest step of ``attempt`` with its node."""
    q = (select(ranks.c.rank, ranks.c.step, ranks.c.t, agents.c.node)
         .join(agents, agents.c.id == ranks.c.agent_id)
         .where(ranks.c.run_id == run_id, ranks.c.attempt == attempt))
    return [_row(r) for r in conn.execute(q)]


def rank_nodes(conn: Connection, *, run_id: int) -> dict[int, str]:
    q = (select(ranks.c.rank, agents.c.node).join(agents, agents.c.id == ranks.c.agent_id)
         .where(ranks.c.run_id == run_id))
    return {int(r[0]): str(r[1]) for r in conn.execute(q)}


def loss_series(conn: Connection, *, run_id: int, attempt: int, limit: int
                ) -> list[dict[str, Any]]:
    """The newest ``limit`` steps of the run's current lineage, oldest first: the steps of
    ``attempt``, and before its first step those of earlier attempts (the latest attempt wins
    a step trained twice).  Loss mean, NaN/Inf counts, samples and times per step."""
    a = step_aggregates.c
    first = first_step(conn, run_id=run_id, attempt=attempt)
    cond = a.attempt == attempt
    if first is not None:  # before the attempt's first step: the history it resumed from
        cond = cond | ((a.attempt < attempt) & (a.step < first))
    elif attempt > 0:
        cond = a.attempt < 0  # nothing yet: judge the new attempt on its own steps
    q = (select(a.attempt, a.step, a.loss_sum, a.loss_count, a.loss_nonfinite,
                a.grad_norm_nonfinite, a.samples, a.tokens, a.t_first, a.t_last)
         .where(a.run_id == run_id, cond)
         .order_by(a.step.desc(), a.attempt.desc()).limit(limit * 2))
    by_step: dict[int, dict[str, Any]] = {}
    for r in conn.execute(q):
        d = _row(r)
        by_step.setdefault(int(d["step"]), d)  # the latest attempt first for each step
    rows = [by_step[k] for k in sorted(by_step)][-limit:]
    for d in rows:
        n = int(d["loss_count"] or 0)
        d["loss"] = (d["loss_sum"] / n) if n and d["loss_sum"] is not None else None
    return rows


def step_range(conn: Connection, *, run_id: int, attempt: int) -> tuple[int, int] | None:
    a = step_aggregates.c
    q = select(func.min(a.step), func.max(a.step)).where(a.run_id == run_id,
                                                          a.attempt == attempt)
    lo, hi = conn.execute(q).one()
    return None if lo is None else (int(lo), int(hi))


def events_after(conn: Connection, *, after_id: int, names: Sequence[str], limit: int = 1000
                 ) -> list[dict[str, Any]]:
    q = (select(events, agents.c.node).outerjoin(agents, agents.c.id == events.c.agent_id)
         .where(events.c.id > after_id, events.c.name.in_(list(names)))
         .order_by(events.c.id).limit(limit))
    return [_row(r) for r in conn.execute(q)]


def ranks_with_event(conn: Connection, *, run_id: int, attempt: int, name: str
                     ) -> frozenset[int]:
    q = (select(events.c.rank).distinct()
         .where(events.c.run_id == run_id, events.c.attempt == attempt, events.c.name == name,
                events.c.rank.is_not(None)))
    return frozenset(int(r[0]) for r in conn.execute(q))


def flops_declaration(conn: Connection, *, run_id: int) -> dict[str, Any] | None:
    """The details of the run's newest ``flops_declared`` event (for MFU), or None."""
    q = (select(events.c.details).where(events.c.run_id == run_id,
                                         events.c.name == "flops_declared")
         .order_by(events.c.id.desc()).limit(1))
    d = conn.execute(q).scalar()
    return d if isinstance(d, dict) else None


def latest_event(conn: Connection, *, run_id: int, attempt: int, name: str
                 ) -> dict[str, Any] | None:
    q = (select(events).where(events.c.run_id == run_id, events.c.attempt == attempt,
                              events.c.name == name)
         .order_by(events.c.id.desc()).limit(1))
    r = conn.execute(q).first()
    return _row(r) if r else None


def latest_event_by_node(conn: Connection, *, run_id: int, names: Sequence[str]
                         ) -> dict[str, str]:
    """node (``details.node``) -> the name of its newest event among ``names``."""
    q = (select(events.c.name, events.c.details)
         .where(events.c.run_id == run_id, events.c.name.in_(list(names)))
         .order_by(events.c.id.desc()).limit(1000))
    out: dict[str, str] = {}
    for name, details in conn.execute(q):
        node = (details or {}).get("node") if isinstance(details, dict) else None
        if isinstance(node, str):
            out.setdefault(node, str(name))
    return out


def recent_save_seconds(conn: Connection, *, run_id: int, limit: int = 10) -> list[float]:
    q = (select(checkpoints.c.save_s).where(checkpoints.c.run_id == run_id,
                                            checkpoints.c.save_s.is_not(None))
         .order_by(checkpoints.c.id.desc()).limit(limit))
    return [float(r[0]) for r in conn.execute(q)]


def newest_checkpoint_time(conn: Connection, *, run_id: int) -> float | None:
    q = select(func.max(checkpoints.c.t)).where(checkpoints.c.run_id == run_id)
    v = conn.execute(q).scalar_one()
    return None if v is None else float(v)


def restart_action_for(conn: Connection, *, run_id: int, attempt: int
                       ) -> dict[str, Any] | None:
    """The restart action that started ``attempt`` (the newest one, if several)."""
    q = (select(actions).where(actions.c.run_id == run_id, actions.c.kind == "restart",
                               actions.c.attempt == attempt)
         .order_by(actions.c.id.desc()).limit(1))
    r = conn.execute(q).first()
    return _row(r) if r else None


def incidents_of(conn: Connection, *, run_id: int, attempt: int | None = None,
                 kinds: Sequence[str] | None = None, status: str | None = None
                 ) -> list[dict[str, Any]]:
    cond = [incidents.c.run_id == run_id]
    if attempt is not None:
        cond.append(incidents.c.attempt == attempt)
    if kinds is not None:
        cond.append(incidents.c.kind.in_(list(kinds)))
    if status is not None:
        cond.append(incidents.c.status == status)
    q = select(incidents).where(*cond).order_by(incidents.c.id)
    return [_row(r) for r in conn.execute(q)]


def get_incident(conn: Connection, *, incident_id: int) -> dict[str, Any] | None:
    r = conn.execute(select(incidents).where(incidents.c.id == incident_id)).first()
    return _row(r) if r else None


def update_incident(conn: Connection, *, incident_id: int, **values: Any) -> None:
    conn.execute(update(incidents).where(incidents.c.id == incident_id).values(**values))


def resolve_incident(conn: Connection, *, incident_id: int, now: float) -> None:
    conn.execute(update(incidents).where(incidents.c.id == incident_id)
                 .values(status="resolved", resolved_at=now, updated_at=now))


def incident_for_command(conn: Connection, *, command_id: int) -> int | None:
    q = (select(actions.c.incident_id).join(commands, commands.c.action_id == actions.c.id)
         .where(commands.c.id == command_id))
    v = conn.execute(q).scalar()
    return None if v is None else int(v)


def insert_event(conn: Connection, **values: Any) -> None:
    values.setdefault("details", {})
    values.setdefault("message", "")
    conn.execute(events.insert().values(**values))


def lineage_checkpoints(conn: Connection, *, run_id: int) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints of the current lineage, oldest first (a step
    saved twice counts once, with its newest save)."""
    c = checkpoints.c
    q = (select(c.step, c.path).where(c.run_id == run_id, c.complete.is_(True),
                                      c.abandoned.is_(False)).order_by(c.t, c.id))
    by_step = {int(r[0]): str(r[1]) for r in conn.execute(q)}
    return sorted(by_step.items())


def lineage_checkpoint_times(conn: Connection, *, run_id: int
                             ) -> list[tuple[int, float, str]]:
    """(step, saved at, path) of the complete checkpoints of the current lineage, oldest
    first (a step saved twice counts once, with its newest save)."""
    c = checkpoints.c
    q = (select(c.step, c.t, c.path).where(c.run_id == run_id, c.complete.is_(True),
                                           c.abandoned.is_(False)).order_by(c.t, c.id))
    by_step = {int(r[0]): (float(r[1]), str(r[2])) for r in conn.execute(q)}
    return [(s, t, p) for s, (t, p) in sorted(by_step.items())]


def set_protected(conn: Connection, *, run_id: int, paths: list[str]) -> None:
    conn.execute(update(runs).where(runs.c.id == run_id).values(protected=paths))


def abandon_branches(conn: Connection, *, run_id: int) -> int:
    """Mark the checkpoints a rollback abandoned: those written by an attempt before the
    rollback's attempt, beyond the step it went back to.  They are never offered as the
    newest again.  Run when a rollback is decided and again on every evaluator tick: the old
    workers keep saving until the restart reaches them, and those late reports arrive after
    the decision.  Returns how many were marked now."""
    ck, ac = checkpoints.c, actions.c
    beyond = (select(literal(1)).where(
        ac.run_id == ck.run_id, ac.rollback_to_step.is_not(None), ck.attempt < ac.attempt,
        ck.step > ac.rollback_to_step).exists())
    r = conn.execute(update(checkpoints)
                     .where(ck.run_id == run_id, ck.abandoned.is_(False), beyond)
                     .values(abandoned=True))
    return int(r.rowcount or 0)


def checkpoint_by(conn: Connection, *, run_id: int, checkpoint_id: int | None = None,
                  step: int | None = None) -> dict[str, Any] | None:
    """One checkpoint of a run by id, or the newest save of a step."""
    c = checkpoints.c
    q = select(checkpoints).where(c.run_id == run_id)
    if checkpoint_id is not None:
        q = q.where(c.id == checkpoint_id)
    if step is not None:
        q = q.where(c.step == step)
    r = conn.execute(q.order_by(c.t.desc(), c.id.desc()).limit(1)).first()
    return _row(r) if r else None


def batch_indexes(conn: Connection, *, run_id: int, steps: Sequence[int]) -> dict[int, int]:
    """step -> global batch index trained at that step (rank 0, the newest attempt)."""
    if not steps:
        return {}
    c = rank_steps.c
    q = (select(c.step, c.batch_index).where(c.run_id == run_id, c.rank == 0,
                                             c.step.in_(list(steps)),
                                             c.batch_index.is_not(None))
         .order_by(c.attempt))
    return {int(r[0]): int(r[1]) for r in conn.execute(q)}


def restart_history(conn: Connection, *, run_id: int) -> list[dict[str, Any]]:
    """The run's restart actions, oldest first (each decided one spent budget, even if a
    newer decision superseded it before the agents picked it up)."""
    q = (select(actions.c.cause, actions.c.high_step, actions.c.actor)
         .where(actions.c.run_id == run_id, actions.c.kind == "restart")
         .order_by(actions.c.id))
    return [_row(r) for r in conn.execute(q)]


def high_step(conn: Connection, *, run_id: int) -> int | None:
    v = conn.execute(select(func.max(step_aggregates.c.step))
                     .where(step_aggregates.c.run_id == run_id)).scalar_one()
    return None if v is None else int(v)


def max_event_id(conn: Connection) -> int:
    v = conn.execute(select(func.max(events.c.id))).scalar_one()
    return int(v or 0)


# ---------------------------------------------------------------------------------------------
# reads for the API


def steps(
    conn: Connection,
    *,
    run_id: int,
    step_from: int | None,
    step_to: int | None,
    max_points: int,
    attempt: int | None = None,
) -> list[dict[str, Any]]:
    """Per-step aggregates, bucketed by step range on the server when there are more than
    ``max_points`` of them (each bucket: loss min/max/mean, sums, worst step time)."""
    a = step_aggregates.c
    cond = [a.run_id == run_id]
    if step_from is not None:
        cond.append(a.step >= step_from)
    if step_to is not None:
        cond.append(a.step <= step_to)
    if attempt is not None:
        cond.append(a.attempt == attempt)
    bounds = conn.execute(
        select(func.count(), func.min(a.step), func.max(a.step)).where(*cond)
    ).one()
    n, lo, hi = int(bounds[0]), bounds[1], bounds[2]
    if n == 0:
        return []
    if n <= max_points:
        q = select(step_aggregates).where(*cond).order_by(a.step, a.attempt)
        out = []
        for r in conn.execute(q):
            d = _row(r)
            out.append(_point(
                step_from=d["step"], step_to=d["step"], attempt=d["attempt"], rows=1,
                ranks=d["ranks"], loss_sum=d["loss_sum"], loss_count=d["loss_count"],
                loss_min=d["loss_min"], loss_max=d["loss_max"],
                loss_nonfinite=d["loss_nonfinite"], grad_norm_nonfinite=d["grad_norm_nonfinite"],
                samples=d["samples"], tokens=d["tokens"], step_s_max=d["step_s_max"],
                t=d["t_last"],
            ))
        return out
    width = max(1, math.ceil((hi - lo + 1) / max_points))
    bucket = ((a.step - lo) // width).label("bucket")  # floor division on both backends
    q = (
        select(
            bucket,
            func.min(a.step), func.max(a.step), func.max(a.attempt), func.count(),
            func.sum(a.ranks), func.sum(a.loss_sum), func.sum(a.loss_count),
            func.min(a.loss_min), func.max(a.loss_max), func.sum(a.loss_nonfinite),
            func.sum(a.grad_norm_nonfinite), func.sum(a.samples), func.sum(a.tokens),
            func.max(a.step_s_max), func.max(a.t_last),
        )
        .where(*cond)
        .group_by(bucket)
        .order_by(bucket)
    )
    return [
        _point(
            step_from=r[1], step_to=r[2], attempt=r[3], rows=r[4], ranks=r[5], loss_sum=r[6],
            loss_count=r[7], loss_min=r[8], loss_max=r[9], loss_nonfinite=r[10],
            grad_norm_nonfinite=r[11], samples=r[12], tokens=r[13], step_s_max=r[14], t=r[15],
        )
        for r in conn.execute(q)
    ]


def _point(*, loss_sum: float | None, loss_count: int | None, **kw: Any) -> dict[str, Any]:
    count = int(loss_count or 0)
    kw["loss_mean"] = (loss_sum / count) if count and loss_sum is not None else None
    for k in ("rows", "ranks", "loss_nonfinite", "grad_norm_nonfinite", "samples", "tokens"):
        kw[k] = int(kw[k] or 0)
    return kw


def _with_specials(d: dict[str, Any]) -> dict[str, Any]:
    """A per-rank row with its NaN/Inf loss and grad norm put back (see ``split_float``)."""
    d["loss"] = join_float(d["loss"], d.pop("loss_special"))
    d["grad_norm"] = join_float(d["grad_norm"], d.pop("grad_norm_special"))
    return d


def rank_latest(conn: Connection, *, run_id: int) -> list[dict[str, Any]]:
    q = (
        select(ranks, agents.c.node)
        .join(agents, agents.c.id == ranks.c.agent_id)
        .where(ranks.c.run_id == run_id)
        .order_by(ranks.c.rank)
    )
    return [_with_specials(_row(r)) for r in conn.execute(q)]


def rank_steps_for(
    conn: Connection, *, run_id: int, attempt: int, step_from: int, step_to: int
) -> list[dict[str, Any]]:
    """Per-rank rows of a step range (NaN restored): the detectors' input."""
    c = rank_steps.c
    q = (
        select(rank_steps)
        .where(c.run_id == run_id, c.attempt == attempt, c.step >= step_from, c.step <= step_to)
        .order_by(c.step, c.rank)
    )
    return [_with_specials(_row(r)) for r in conn.execute(q)]


def _list(conn: Connection, table: Table, run_id: int, order: Iterable[Any], limit: int
          ) -> list[dict[str, Any]]:
    q = select(table).where(table.c.run_id == run_id).order_by(*order).limit(limit)
    return [_row(r) for r in conn.execute(q)]


def list_checkpoints(conn: Connection, *, run_id: int, limit: int = 1000) -> list[dict[str, Any]]:
    return _list(conn, checkpoints, run_id, [checkpoints.c.t.desc(), checkpoints.c.id.desc()],
                 limit)


def list_incidents(conn: Connection, *, run_id: int, limit: int = 1000) -> list[dict[str, Any]]:
    return _list(conn, incidents, run_id, [incidents.c.id.desc()], limit)


def list_actions(conn: Connection, *, run_id: int, limit: int = 1000) -> list[dict[str, Any]]:
    return _list(conn, actions, run_id, [actions.c.id.desc()], limit)


def list_events(conn: Connection, *, run_id: int, limit: int = 1000) -> list[dict[str, Any]]:
    return _list(conn, events, run_id, [events.c.t.desc(), events.c.id.desc()], limit)


def list_commands(conn: Connection, *, run_id: int) -> list[dict[str, Any]]:
    q = select(commands).where(commands.c.run_id == run_id).order_by(commands.c.id)
    return [_row(r) for r in conn.execute(q)]


def count_rows(conn: Connection, *, table: str) -> int:
    """Row count of one table (tests and benchmarks)."""
    t = {tb.name: tb for tb in (runs, agents, ranks, rank_steps, step_aggregates, checkpoints,
                                events, exits, incidents, actions, commands, ingested_batches)}
    return int(conn.execute(select(func.count()).select_from(t[table])).scalar_one())


def bulk_insert_rank_steps(conn: Connection, *, rows: list[dict[str, Any]]) -> None:
    """Raw bulk insert (the benchmark's baseline)."""
    conn.execute(rank_steps.insert(), rows)


def ping(conn: Connection) -> None:
    conn.execute(select(literal(1)))


# ---- dashboard and metrics reads ----


def runs_for_metrics(conn: Connection, *, active: Sequence[str], since: float
                     ) -> list[dict[str, Any]]:
    """Runs in an ``active`` status, or whose status changed at or after ``since``."""
    q = select(runs).where(or_(runs.c.status.in_(list(active)), runs.c.updated_at >= since))
    return [_row(r) for r in conn.execute(q.order_by(runs.c.id))]


def newest_step(conn: Connection, *, run_id: int) -> dict[str, Any] | None:
    """The newest step aggregate of the newest attempt that has one (any attempt)."""
    a = step_aggregates.c
    q = (select(step_aggregates).where(a.run_id == run_id)
         .order_by(a.attempt.desc(), a.step.desc()).limit(1))
    r = conn.execute(q).first()
    return _row(r) if r else None


def max_step_by_attempt(conn: Connection, *, run_id: int) -> dict[int, int]:
    a = step_aggregates.c
    q = select(a.attempt, func.max(a.step)).where(a.run_id == run_id).group_by(a.attempt)
    return {int(r[0]): int(r[1]) for r in conn.execute(q)}


def open_incident_counts(conn: Connection, *, run_id: int) -> dict[str, int]:
    i = incidents.c
    q = (select(i.kind, func.count()).where(i.run_id == run_id, i.status == "open")
         .group_by(i.kind))
    return {str(r[0]): int(r[1]) for r in conn.execute(q)}


def restart_actions(conn: Connection, *, run_id: int) -> list[dict[str, Any]]:
    """Every restart-like action of a run with the kind of the incident behind it (if any)."""
    ac = actions.c
    q = (
        select(ac.id, ac.kind, ac.actor, ac.status, ac.attempt, ac.resumed_step,
               ac.created_at, ac.cause, incidents.c.kind.label("incident_kind"))
        .select_from(actions.outerjoin(incidents, incidents.c.id == ac.incident_id))
        .where(ac.run_id == run_id, ac.kind.in_(("restart", "rollback")))
        .order_by(ac.id)
    )
    return [_row(r) for r in conn.execute(q)]


def rank_phase_rows(conn: Connection, *, run_id: int, attempt: int, step_from: int,
                    step_to: int | None = None) -> list[dict[str, Any]]:
    """{step, rank, data_s, compute_s} of one attempt from ``step_from`` (to ``step_to``): the
    straggler detector's input, read every tick for every rank of the newest steps (tens of
    thousands of rows for a big run), so built from plain tuples."""
    c = rank_steps.c
    cond = [c.run_id == run_id, c.attempt == attempt, c.step >= step_from]
    if step_to is not None:
        cond.append(c.step <= step_to)
    q = select(c.step, c.rank, c.data_s, c.compute_s).where(*cond).order_by(c.step, c.rank)
    return [{"step": s, "rank": r, "data_s": d, "compute_s": cs}
            for s, r, d, cs in conn.execute(q)]


def rank_phase_rows_after(conn: Connection, *, run_id: int, attempt: int, after_id: int
                          ) -> list[tuple[int, int, int, float | None, float | None]]:
    """(id, step, rank, data_s, compute_s) of one attempt stored after row ``after_id``: what
    an incremental straggler window reads each time.  The run and attempt are compared as
    expressions on purpose, so that both SQLite and Postgres walk the primary key from
    ``after_id`` (the new rows only) instead of the (run, attempt, step) index (every row of a
    long attempt).  Rows of one run are committed in id order (one ingest writer)."""
    c = rank_steps.c
    q = (select(c.id, c.step, c.rank, c.data_s, c.compute_s)
         .where(c.id > after_id, c.run_id + 0 == run_id, c.attempt + 0 == attempt)
         .order_by(c.id))
    return [(int(i), int(st), int(r), d, cs) for i, st, r, d, cs in conn.execute(q)]


def max_rank_step_id(conn: Connection) -> int:
    return int(conn.execute(select(func.max(rank_steps.c.id))).scalar_one() or 0)


def rank_node_names(conn: Connection, *, run_id: int) -> dict[int, str]:
    """Each rank's node (from its latest report)."""
    q = (select(ranks.c.rank, agents.c.node).join(agents, agents.c.id == ranks.c.agent_id)
         .where(ranks.c.run_id == run_id))
    return {int(r[0]): str(r[1]) for r in conn.execute(q)}


def run_fingerprint(conn: Connection, *, run_id: int) -> tuple[Any, ...]:
    """Cheap summary that changes whenever what the dashboard shows of a run changes (except
    the agents' last-seen times, which move with every batch)."""
    a, i, ac, ck, ag = (step_aggregates.c, incidents.c, actions.c, checkpoints.c, agents.c)
    run = conn.execute(
        select(runs.c.status, runs.c.attempt, runs.c.restarts, runs.c.updated_at)
        .where(runs.c.id == run_id)
    ).one()
    last = conn.execute(
        select(a.attempt, a.step, a.ranks, a.t_last).where(a.run_id == run_id)
        .order_by(a.attempt.desc(), a.step.desc()).limit(1)
    ).first()
    inc_cols = [func.count(), func.max(i.id), func.max(i.resolved_at)]
    if "updated_at" in i:  # details of an ongoing incident change while it lasts
        inc_cols.append(func.max(i.updated_at))
    inc = conn.execute(select(*inc_cols).where(i.run_id == run_id)).one()
    act = conn.execute(
        select(func.count(), func.max(ac.updated_at)).where(ac.run_id == run_id)
    ).one()
    ckpt = conn.execute(select(func.count(), func.max(ck.id)).where(ck.run_id == run_id)).one()
    agt = conn.execute(
        select(ag.id, ag.state, ag.attempt, ag.disk_free_bytes, ag.dropped)
        .where(ag.run_id == run_id).order_by(ag.id)
    ).all()
    return (tuple(run), tuple(last) if last else None, tuple(inc), tuple(act), tuple(ckpt),
            tuple(tuple(r) for r in agt))


def get_action(conn: Connection, *, action_id: int) -> dict[str, Any] | None:
    r = conn.execute(select(actions).where(actions.c.id == action_id)).first()
    return _row(r) if r else None

"""The ingest hot path: agent batches into the store, and the commands each reply carries.

Written for throughput: one transaction per group of batches (the caller's), multi-row VALUES
statements run on the DBAPI cursor, rows pre-reduced in Python so each upsert touches a key
once, and the contended per-step aggregate upsert placed last so its row lock (Postgres) is
held only until the commit.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy import (
    JSON,
    BigInteger,
    Connection,
    String,
    and_,
    bindparam,
    func,
    literal_column,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from trainwarden.agent.core.states import CommandStatus
from trainwarden.supervisor.contract import checkpoint_paths, wire
from trainwarden.supervisor.enums import SupervisorEvent
from trainwarden.supervisor.store._sql import finite, greatest, json_safe, least, nsum, split_float
from trainwarden.supervisor.store.health import gpu_health, worker_stats
from trainwarden.supervisor.store.tables import (
    agents,
    checkpoints,
    commands,
    events,
    exits,
    ingested_batches,
    rank_steps,
    ranks,
    runs,
    step_aggregates,
)


@dataclass(frozen=True)
class IngestConfig:
    # An agent timestamp (t of a step, event, checkpoint, exit, heartbeat; a batch's sent_at)
    # more than this many seconds ahead of the supervisor's clock is replaced by the receive
    # time (and counted in a clock_skew event).  1 day: a clock an hour or a time zone off
    # (up to 14 h) still passes, a clock years ahead does not
    clock_ahead_s: float = 86_400.0
    # An agent timestamp more than this many seconds behind the supervisor's clock is
    # replaced the same way.  30 days: an agent cut off for weeks replays its spool with the
    # true times; a clock at 1970 (no RTC, no NTP) is caught
    clock_behind_s: float = 30 * 86_400.0

    def __post_init__(self) -> None:
        for name in ("clock_ahead_s", "clock_behind_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"ingest.{name} must be a positive number of seconds "
                                 f"(got {v})")


# One clock_skew event per agent per this many seconds (of the supervisor's clock); the
# timestamps replaced meanwhile are added to its count.
CLOCK_SKEW_EVENT_S = 3600.0


class _ClockCheck:
    """One batch's agent timestamps against the supervisor's clock: a time that is not
    finite, or further off than the configured skew, becomes the receive time."""

    def __init__(self, now: float, cfg: IngestConfig) -> None:
        self.now = now
        self.lo, self.hi = now - cfg.clock_behind_s, now + cfg.clock_ahead_s
        self.replaced: dict[str, int] = {}
        self.worst: float | None = None  # the replaced value furthest off (finite ones)
        self.nonfinite = 0

    def t(self, value: float | None, default: float, what: str) -> float:
        if value is None:
            return default
        if self.lo <= value <= self.hi:  # (False for NaN)
            return value
        self.replaced[what] = self.replaced.get(what, 0) + 1
        if not math.isfinite(value):
            self.nonfinite += 1
        elif self.worst is None or abs(value - self.now) > abs(self.worst - self.now):
            self.worst = value
        return self.now


@dataclass
class IngestResult:
    run_id: int
    attempt: int
    duplicate: bool
    commands: list[dict[str, Any]]
    protect: list[str] = field(default_factory=list)  # checkpoint paths to keep


class UnknownAgent(LookupError):
    pass


class CheckpointRefused(ValueError):
    """A batch reporting a checkpoint outside the agent's registered roots: nothing of it is
    stored.  ``errors``: one ``{"loc", "msg", "type"}`` per refused path (``loc`` within the
    batch, as a 422 names it)."""

    def __init__(self, agent_id: int, errors: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(e["msg"] for e in errors))
        self.agent_id = agent_id
        self.errors = errors


class SeqConflict(ValueError):
    """The batch's (agent_id, seq) was stored before with different content: nothing of it is
    stored.  ``next_seq``: the agent's first sequence number not stored yet."""

    def __init__(self, agent_id: int, seq: int, next_seq: int) -> None:
        super().__init__(f"seq {seq} of agent {agent_id} was already used for different "
                         f"content: nothing stored (the agent's next free seq is {next_seq})")
        self.agent_id, self.seq, self.next_seq = agent_id, seq, next_seq


def ingest_batch(conn: Connection, *, batch: wire.IngestBatch, now: float,
                 cfg: IngestConfig = IngestConfig()) -> IngestResult:
    """Store one batch in the caller's transaction (see ``ingest_batches``).

    Raises ``UnknownAgent`` when the agent id was never registered, ``CheckpointRefused``
    when it reports a checkpoint outside its registered roots, ``SeqConflict`` when its
    (agent_id, seq) was stored before with different content."""
    res = ingest_batches(conn, batches=[batch], now=now, cfg=cfg)[0]
    if isinstance(res, UnknownAgent | CheckpointRefused | SeqConflict):
        raise res
    return res


Outcome = IngestResult | UnknownAgent | CheckpointRefused | SeqConflict


def ingest_batches(
    conn: Connection, *, batches: Sequence[wire.IngestBatch], now: float,
    cfg: IngestConfig = IngestConfig(),
) -> list[Outcome]:
    """Store a group of batches in the caller's ONE transaction; results in input order.

    A replayed (agent_id, seq), stored before or earlier in the same group, stores nothing and
    is answered as a duplicate when its content is the same (``IngestBatch.content_digest``),
    with ``SeqConflict`` when it differs.  A batch of an unregistered agent gets
    ``UnknownAgent`` and stores nothing.  A batch reporting a checkpoint path outside the
    agent's registered roots (``trainwarden.supervisor.contract.checkpoint_paths``) gets
    ``CheckpointRefused`` and
    stores nothing (a replay of a batch stored before is still a duplicate); the paths of the
    others are stored normalised.  Rows of all batches go in one multi-row statement per
    table, and the per-step aggregates are merged across the group first: the cost per batch
    falls as the load rises (the ingest writer groups whatever arrived while the last group
    was written).

    Agent timestamps are checked against ``now`` (``IngestConfig``): one that is not finite,
    or further off than the allowed skew, is stored as ``now`` and counted in the agent's
    ``clock_skew`` event.
    """
    hot = _hot(conn)
    ids = sorted({b.agent_id for b in batches})
    cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        return _ingest_group(conn, hot, cur, batches, ids, now, cfg)
    finally:
        cur.close()


def _ingest_group(conn: Connection, hot: _HotSQL, cur: Any,
                  batches: Sequence[wire.IngestBatch], ids: list[int], now: float,
                  cfg: IngestConfig) -> list[Outcome]:
    # agent id -> (run id, the run's attempt, its protected checkpoints)
    heads: dict[int, tuple[int, int, list[str]]]
    if len(ids) == 1:  # the common case on SQLite: the raw single-agent statement
        r = hot.fetchone(cur, "head", {"agent_id": ids[0]})
        heads = {ids[0]: (int(r[0]), int(r[1]), _json_list(r[2]))} if r else {}
    else:
        heads = {int(r[0]): (int(r[1]), int(r[2]), _json_list(r[3]))
                 for r in conn.execute(_HEADS, {"ids": ids})}
    refused, paths = _checkpoint_paths(conn, batches, heads)
    # Claim each (agent_id, seq) once; RETURNING, not rowcount, says which ones were new.
    wanted: dict[tuple[int, int], dict[str, Any]] = {}
    digests: list[str | None] = []
    for i, b in enumerate(batches):
        d = b.content_digest() if b.agent_id in heads else None
        digests.append(d)
        if b.agent_id in heads and i not in refused and (b.agent_id, b.seq) not in wanted:
            wanted[(b.agent_id, b.seq)] = {"agent_id": b.agent_id, "seq": b.seq,
                                           "received_at": now, "items": len(b.items),
                                           "digest": d}
    claimed = {(int(r[0]), int(r[1]))
               for r in hot.insert_rows(cur, "claim", list(wanted.values()), fetch=True)}
    # The content already stored under each replayed key (what this group claimed counts).
    known = {k: w["digest"] for k, w in wanted.items() if k in claimed}
    replayed = [k for k in wanted if k not in claimed]
    if replayed:
        known.update(_stored_digests(conn, keys=replayed))
    acc = _Acc()
    duplicate: list[bool] = []
    conflicts: dict[int, SeqConflict] = {}
    for i, b in enumerate(batches):
        key = (b.agent_id, b.seq)
        new = key in claimed and i not in refused
        claimed.discard(key)  # a second copy in this group is a replay
        duplicate.append(not new)
        if new:
            _collect(acc, b, run_id=heads[b.agent_id][0], now=now, cfg=cfg,
                     paths=paths.get(i, []))
        elif (b.agent_id in heads and i not in refused
              and known.get(key) not in (None, digests[i])):
            conflicts[i] = SeqConflict(b.agent_id, b.seq, _next_seq(conn, agent_id=b.agent_id))
    aggs = _flush(conn, hot, cur, acc, now=now)
    # After this group's acknowledgements, so an acknowledged command is not re-sent.
    # (Not for an agent whose batches were all refused: its reply carries none.)
    answered = sorted({b.agent_id for i, b in enumerate(batches)
                       if b.agent_id in heads and i not in conflicts and i not in refused})
    pending = _pending(conn, hot, cur, answered, now)
    if aggs:
        # Last, right before the commit: every agent of a run updates the same step row,
        # and Postgres holds that row lock until the commit.  Sorted keys: concurrent
        # writers lock rows in the same order (no deadlock).
        hot.insert_rows(cur, "aggregates", aggs)
    out: list[Outcome] = []
    for i, (b, dup) in enumerate(zip(batches, duplicate, strict=True)):
        if b.agent_id not in heads:
            out.append(UnknownAgent(b.agent_id))
            continue
        if i in refused:
            out.append(refused[i])
            continue
        if i in conflicts:
            out.append(conflicts[i])
            continue
        run_id, attempt, protect = heads[b.agent_id]
        out.append(IngestResult(run_id=run_id, attempt=attempt, duplicate=dup,
                                commands=pending.get(b.agent_id, []), protect=protect))
    return out


def _checkpoint_paths(conn: Connection, batches: Sequence[wire.IngestBatch],
                      heads: dict[int, Any]
                      ) -> tuple[dict[int, CheckpointRefused], dict[int, list[str]]]:
    """Batch index -> its refusal, and batch index -> its checkpoint paths normalised (in
    item order), for the batches of known agents that report checkpoints.  A refused batch
    that was stored before (a replay, from before the agent's roots changed) is left to the
    duplicate check instead."""
    wanted = sorted({b.agent_id for b in batches if b.agent_id in heads
                     and any(isinstance(it, wire.CheckpointItem) for it in b.items)})
    if not wanted:  # the common case: no extra statement
        return {}, {}
    roots = {int(r[0]): [x for x in (r[1] or []) if isinstance(x, str)]
             for r in conn.execute(select(agents.c.id, agents.c.checkpoint_roots)
                                   .where(agents.c.id.in_(wanted)))}
    refused: dict[int, CheckpointRefused] = {}
    paths: dict[int, list[str]] = {}
    for i, b in enumerate(batches):
        if b.agent_id not in roots:
            continue
        ok: list[str] = []
        errors: list[dict[str, Any]] = []
        for j, it in enumerate(b.items):
            if not isinstance(it, wire.CheckpointItem):
                continue
            try:
                ok.append(checkpoint_paths.resolve(it.path, roots[b.agent_id]))
            except checkpoint_paths.OutsideRoots as e:
                errors.append({"loc": ["items", str(j), "path"], "msg": str(e),
                               "type": "checkpoint_outside_roots"})
        if not errors:
            paths[i] = ok
        elif conn.execute(select(ingested_batches.c.seq).where(
                ingested_batches.c.agent_id == b.agent_id,
                ingested_batches.c.seq == b.seq)).first() is None:
            refused[i] = CheckpointRefused(b.agent_id, errors)
    return refused, paths


def _stored_digests(conn: Connection, *, keys: list[tuple[int, int]]
                    ) -> dict[tuple[int, int], str | None]:
    """The content digests stored under replayed (agent_id, seq) keys (the rare path)."""
    ib = ingested_batches.c
    q = select(ib.agent_id, ib.seq, ib.digest).where(
        or_(*(and_(ib.agent_id == a, ib.seq == s) for a, s in keys)))
    return {(int(r[0]), int(r[1])): r[2] for r in conn.execute(q)}


def _next_seq(conn: Connection, *, agent_id: int) -> int:
    top = conn.execute(select(func.max(ingested_batches.c.seq))
                       .where(ingested_batches.c.agent_id == agent_id)).scalar_one()
    return 0 if top is None else int(top) + 1


def _json_list(raw: Any) -> list[str]:
    """A JSON list column read on the raw cursor (text on SQLite, decoded on Postgres)."""
    if isinstance(raw, str | bytes):
        raw = json.loads(raw)
    return [str(x) for x in raw] if isinstance(raw, list) else []


def _pending(conn: Connection, hot: _HotSQL, cur: Any, agent_ids: list[int], now: float
             ) -> dict[int, list[dict[str, Any]]]:
    if len(agent_ids) != 1:
        return _pending_many(conn, agent_ids=agent_ids, now=now)
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
_ATTEMPT, _STEP = STEP_KEYS.index("attempt"), STEP_KEYS.index("step")
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
                ("agent_id", "seq", "received_at", "items", "digest"),
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
        if self.sql["rank_steps"][1] != STEP_KEYS:  # (the step loop builds rows in this order)
            raise RuntimeError(f"rank_steps binds {self.sql['rank_steps'][1]}, not STEP_KEYS")
        self._multi: dict[tuple[str, int], str] = {}
        # Postgres: psycopg parses a statement's %s placeholders in Python on every execute,
        # and caches that only for statements under 4 KiB and 50 parameters: a multi-row
        # statement of hundreds of rows cost most of the writer's time there.  So multi-row
        # statements are numbered ($1, $2, ...) once, here, and sent on a raw cursor, which
        # passes them to the server unparsed.
        self.raw = dialect.name == "postgresql"

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
        order = self.sql[name][1]
        return self.insert_tuples(cur, name, [tuple(row[k] for k in order) for row in rows],
                                  fetch=fetch)

    def insert_tuples(self, cur: Any, name: str, rows: list[tuple[Any, ...]], *,
                      fetch: bool = False) -> list[Any]:
        """``insert_rows`` of rows given as tuples in the statement's column order."""
        sql, order = self.sql[name]
        per = max(1, min(MAX_ROWS_PER_STATEMENT, MAX_PARAMS // max(1, len(order))))
        out: list[Any] = []
        for i in range(0, len(rows), per):
            chunk = rows[i:i + per]
            key = (name, len(chunk))
            multi = self._multi.get(key)
            if multi is None:
                multi = _repeat_values(sql, len(chunk))
                self._multi[key] = multi = _numbered(multi) if self.raw else multi
            params = tuple(itertools.chain.from_iterable(chunk))
            if self.raw:
                with psycopg.RawCursor(cur.connection) as raw:
                    raw.execute(multi, params)
                    if fetch:
                        out.extend(raw.fetchall())
                continue
            cur.execute(multi, params)
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


_FORMAT_TOKEN = re.compile(r"%[%s]")


def _numbered(sql: str) -> str:
    """A statement in the "format" paramstyle (``%s``, ``%%``) with numbered placeholders
    (``$1``, ``$2``, ...) and literal percent signs, as a raw cursor sends it."""
    n = 0

    def sub(m: re.Match[str]) -> str:
        nonlocal n
        if m.group() == "%%":
            return "%"
        n += 1
        return f"${n}"

    return _FORMAT_TOKEN.sub(sub, sql)


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

    # rank_steps rows as tuples in STEP_KEYS order (what the multi-row statement binds)
    step_rows: list[tuple[Any, ...]] = field(default_factory=list)
    # (run id, rank) -> the newest step row of the rank and its agent (the ranks upsert's
    # row is built from it once, at the flush: a batch holds several steps of each rank)
    latest_rank: dict[tuple[int, int], tuple[tuple[Any, ...], int, wire.StepItem]] = field(
        default_factory=dict)
    aggs: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    seen: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)
    results: list[tuple[int, int, wire.CommandResultItem, float]] = field(default_factory=list)
    # (run id, agent id, attempt, the batch's check) of batches with timestamps replaced
    skews: list[tuple[int, int, int, _ClockCheck]] = field(default_factory=list)


def _collect(acc: _Acc, batch: wire.IngestBatch, *, run_id: int, now: float,
             cfg: IngestConfig, paths: list[str]) -> None:
    """``paths``: the batch's checkpoint paths as checked (``_checkpoint_paths``)."""
    agent_id = batch.agent_id
    checked = iter(paths)
    clk = _ClockCheck(now, cfg)
    t0 = clk.t(batch.sent_at, now, "sent_at")
    heartbeat: wire.HeartbeatItem | None = None
    # The step rows are nearly all of a batch: their loop is written out for speed (the
    # common values, finite and within the clock's bounds, take the short branch).
    lo, hi, isfinite = clk.lo, clk.hi, math.isfinite
    step_rows, latest = acc.step_rows, acc.latest_rank
    for it in batch.items:
        if isinstance(it, wire.StepItem):
            attempt = it.attempt if it.attempt is not None else batch.attempt
            t = it.t
            if t is None:
                t = t0
            elif not lo <= t <= hi:  # (also NaN)
                t = clk.t(t, t0, "step")
            loss, loss_sp = it.loss, None
            if loss is not None and not isfinite(loss):
                loss, loss_sp = split_float(loss)
            gn, gn_sp = it.grad_norm, None
            if gn is not None and not isfinite(gn):
                gn, gn_sp = split_float(gn)
            step_s = finite(it.step_s)
            row = (run_id, attempt, it.step, it.rank, t, it.batch_index, finite(it.data_s),
                   finite(it.compute_s), step_s, loss, loss_sp, gn, gn_sp, finite(it.lr))
            step_rows.append(row)
            key = (run_id, it.rank)
            prev = latest.get(key)
            if prev is None or (attempt, it.step) >= (prev[0][_ATTEMPT], prev[0][_STEP]):
                latest[key] = (row, agent_id, it)
            _merge_agg(acc.aggs, run_id, attempt, it, t=t, loss=loss, loss_special=loss_sp,
                       grad_norm_special=gn_sp, step_s=step_s)
        elif isinstance(it, wire.EventItem):
            acc.events.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "rank": it.rank, "t": clk.t(it.t, t0, "event"), "name": it.name,
                "step": it.step, "message": it.message, "details": json_safe(it.details),
            })
        elif isinstance(it, wire.CheckpointItem):
            acc.checkpoints.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "step": it.step, "path": next(checked), "bytes": it.bytes,
                "lineage": it.lineage,
                "complete": it.complete, "save_s": finite(it.save_s),
                "async_save": it.async_save, "stall_s": finite(it.stall_s),
                "t": clk.t(it.t, t0, "checkpoint"),
            })
        elif isinstance(it, wire.HeartbeatItem):
            clk.t(it.t, t0, "heartbeat")  # (not stored: checked to be counted)
            heartbeat = it
        elif isinstance(it, wire.ExitItem):
            acc.exits.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "t": clk.t(it.t, t0, "exit"), "exit_code": it.exit_code,
                "signal": it.signal, "outcome": it.outcome,
                "failed_ranks": json_safe([f.model_dump(exclude_unset=True)
                                           for f in it.failed_ranks]),
                "handled": False, "verdict": None,
            })
        else:
            acc.results.append((agent_id, run_id, it, clk.t(it.t, t0, "command_result")))
    if clk.replaced:
        acc.skews.append((run_id, agent_id, batch.attempt, clk))
    acc.seen.append({
        "agent_id": agent_id, "now": now, "dropped": batch.dropped, "attempt": batch.attempt,
        "state": heartbeat.state if heartbeat else None,
        "disk": heartbeat.disk_free_bytes if heartbeat else None,
        "disk_total": heartbeat.disk_total_bytes if heartbeat else None,
        # JSON text for the raw statement (a cast to JSON on Postgres); None keeps the last.
        "workers": _worker_stats(heartbeat.workers) if heartbeat else None,
        "gpus": (json.dumps(gpu_health(heartbeat.gpus), separators=(",", ":"))
                 if heartbeat and heartbeat.gpus is not None else None),
    })


def _rank_row(step_row: tuple[Any, ...], agent_id: int, it: wire.StepItem) -> dict[str, Any]:
    """The ranks upsert's row of a rank's newest step row."""
    row = dict(zip(STEP_KEYS, step_row, strict=True))
    return {
        "run_id": row["run_id"], "rank": row["rank"], "agent_id": agent_id,
        "local_rank": it.local_rank, "pid": it.pid, "attempt": row["attempt"],
        "step": row["step"], "t": row["t"], "data_s": row["data_s"],
        "compute_s": row["compute_s"], "step_s": row["step_s"], "loss": row["loss"],
        "loss_special": row["loss_special"], "grad_norm": row["grad_norm"],
        "grad_norm_special": row["grad_norm_special"],
    }


def _worker_stats(workers: list[dict[str, Any]]) -> str:
    """The heartbeat's worker list as stored: the known keys with finite numbers only."""
    return json.dumps(worker_stats(workers), separators=(",", ":"))


def _flush(conn: Connection, hot: _HotSQL, cur: Any, acc: _Acc, *, now: float
           ) -> list[dict[str, Any]]:
    """Write the collected rows; returns the step-aggregate rows for the caller to upsert."""
    if acc.seen:
        hot.executemany(cur, "agent_seen", acc.seen)
    if acc.step_rows:
        hot.insert_tuples(cur, "rank_steps", acc.step_rows)
    # Rare items: plain Core statements.
    if acc.events:
        conn.execute(events.insert(), acc.events)
    if acc.checkpoints:
        conn.execute(checkpoints.insert(), acc.checkpoints)
    if acc.exits:
        conn.execute(exits.insert(), acc.exits)
    for agent_id, run_id, res, t in acc.results:
        _apply_command_result(conn, agent_id=agent_id, run_id=run_id, item=res, now=now, t=t)
    for run_id, agent_id, attempt, clk in acc.skews:
        _count_clock_skew(conn, run_id=run_id, agent_id=agent_id, attempt=attempt, clk=clk,
                          now=now)
    if acc.latest_rank:
        hot.insert_rows(cur, "ranks", [_rank_row(*acc.latest_rank[k])
                                       for k in sorted(acc.latest_rank)])
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
           commands.c.status == literal_column(f"'{CommandStatus.PENDING}'"))
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
           commands.c.status == literal_column(f"'{CommandStatus.PENDING}'"))
    .order_by(commands.c.id)
)


def _merge_agg(
    aggs: dict[tuple[int, int, int], dict[str, Any]],
    run_id: int,
    attempt: int,
    it: wire.StepItem,
    *,
    t: float,
    loss: float | None,
    loss_special: str | None,
    grad_norm_special: str | None,
    step_s: float | None,
) -> None:
    """Add one rank-step row (its values as stored) to its step's aggregate."""
    key = (run_id, attempt, it.step)
    a = aggs.get(key)
    if a is None:
        a = aggs[key] = {
            "run_id": run_id, "attempt": attempt, "step": it.step, "ranks": 0,
            "loss_sum": None, "loss_count": 0, "loss_min": None, "loss_max": None,
            "loss_nonfinite": 0, "grad_norm_nonfinite": 0, "samples": 0, "tokens": 0,
            "step_s_max": None, "t_first": t, "t_last": t,
        }
    a["ranks"] += 1
    # (comparisons, not min/max: this runs for every rank-step row)
    if loss is not None:
        if a["loss_count"]:
            a["loss_sum"] += loss
            if loss < a["loss_min"]:
                a["loss_min"] = loss
            if loss > a["loss_max"]:
                a["loss_max"] = loss
        else:
            a["loss_sum"] = a["loss_min"] = a["loss_max"] = loss
        a["loss_count"] += 1
    if loss_special is not None:
        a["loss_nonfinite"] += 1
    if grad_norm_special is not None:
        a["grad_norm_nonfinite"] += 1
    if it.samples:
        a["samples"] += it.samples
    if it.tokens:
        a["tokens"] += it.tokens
    if step_s is not None and (a["step_s_max"] is None or step_s > a["step_s_max"]):
        a["step_s_max"] = step_s
    if t < a["t_first"]:
        a["t_first"] = t
    elif t > a["t_last"]:
        a["t_last"] = t


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
            "loss_sum": nsum(c.loss_sum, ex.loss_sum),
            "loss_count": c.loss_count + ex.loss_count,
            "loss_min": least(c.loss_min, ex.loss_min),
            "loss_max": greatest(c.loss_max, ex.loss_max),
            "loss_nonfinite": c.loss_nonfinite + ex.loss_nonfinite,
            "grad_norm_nonfinite": c.grad_norm_nonfinite + ex.grad_norm_nonfinite,
            "samples": c.samples + ex.samples,
            "tokens": c.tokens + ex.tokens,
            "step_s_max": greatest(c.step_s_max, ex.step_s_max),
            "t_first": least(c.t_first, ex.t_first),
            "t_last": greatest(c.t_last, ex.t_last),
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
    if item.status == CommandStatus.DELIVERED:
        cond.append(commands.c.status == CommandStatus.PENDING)
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
                name=SupervisorEvent.UNKNOWN_COMMAND_RESULT, step=None,
                message=f"command_result for command {item.command_id} not sent to this agent",
                details={"status": item.status, "detail": item.detail},
            ))


def _count_clock_skew(conn: Connection, *, run_id: int, agent_id: int, attempt: int,
                      clk: _ClockCheck, now: float) -> None:
    """Count a batch's replaced timestamps in the agent's ``clock_skew`` event: the one of
    the last ``CLOCK_SKEW_EVENT_S`` if there is one (a skewed clock skews every batch: one
    event an hour, not one a second), else a new one."""
    ev = events.c
    prev = conn.execute(
        select(ev.id, ev.details).where(ev.run_id == run_id, ev.agent_id == agent_id,
                                        ev.name == SupervisorEvent.CLOCK_SKEW,
                                        ev.t >= now - CLOCK_SKEW_EVENT_S)
        .order_by(ev.id.desc()).limit(1)).first()
    old = prev[1] if prev is not None and isinstance(prev[1], dict) else {}
    fields = dict(old.get("fields") or {}) if isinstance(old.get("fields"), dict) else {}
    for k, n in clk.replaced.items():
        fields[k] = int(fields.get(k) or 0) + n
    count = sum(int(v) for v in fields.values() if isinstance(v, int))
    worst = old.get("worst_offset_s")
    if clk.worst is not None:
        off = clk.worst - now
        if not isinstance(worst, int | float) or abs(off) > abs(worst):
            worst = off
    details = {
        "count": count, "fields": fields,
        "nonfinite": int(old.get("nonfinite") or 0) + clk.nonfinite,
        "worst_offset_s": worst, "ahead_s": clk.hi - now, "behind_s": now - clk.lo,
        "first_at": old.get("first_at", now), "last_at": now,
    }
    message = (f"{count} agent timestamp(s) not finite or off the supervisor's clock by more "
               f"than {clk.hi - now:g} s ahead / {now - clk.lo:g} s behind: stored as the "
               "receive time")
    if prev is not None:
        conn.execute(update(events).where(ev.id == prev[0])
                     .values(details=details, message=message))
    else:
        conn.execute(events.insert().values(
            run_id=run_id, agent_id=agent_id, attempt=attempt, rank=None, t=now,
            name=SupervisorEvent.CLOCK_SKEW, step=None, message=message, details=details))


def _mark_sent(conn: Connection, *, ids: list[int], now: float) -> None:
    conn.execute(
        update(commands)
        .where(commands.c.id.in_(ids))
        .values(sent_count=commands.c.sent_count + 1, updated_at=now)
    )


def _pending_many(
    conn: Connection, *, agent_ids: Sequence[int], now: float
) -> dict[int, list[dict[str, Any]]]:
    """Unacknowledged commands of several agents (re-sent with every reply), by agent."""
    if not agent_ids:
        return {}
    out: dict[int, list[dict[str, Any]]] = {}
    for r in conn.execute(_PENDING_MANY, {"ids": list(agent_ids)}):
        d = dict(r._mapping)
        out.setdefault(int(d.pop("agent_id")), []).append(d)
    if out:
        _mark_sent(conn, ids=[c["id"] for cs in out.values() for c in cs], now=now)
    return out


"""The ingest statements, compiled once per dialect and run on the DBAPI cursor
(``HotSQL``), with the column orders the rows are built in."""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Sequence
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
from trainwarden.supervisor.store._sql import greatest, least, nsum
from trainwarden.supervisor.store.tables import (
    agents,
    commands,
    ingested_batches,
    rank_steps,
    ranks,
    runs,
    step_aggregates,
)

# Statement size limits: SQLite allows 32766 parameters (since 3.32), Postgres 65535.
MAX_PARAMS = 30_000


MAX_ROWS_PER_STATEMENT = 1000


# Column order of the hot-path rows (the raw statements bind by these names).
STEP_KEYS = ("run_id", "attempt", "step", "rank", "t", "batch_index", "data_s", "compute_s",
             "step_s", "loss", "loss_special", "grad_norm", "grad_norm_special", "lr")


RANK_KEYS = ("run_id", "rank", "agent_id", "local_rank", "pid", "attempt", "step", "t",
             "data_s", "compute_s", "step_s", "loss", "loss_special", "grad_norm",
             "grad_norm_special")


ATTEMPT_COLUMN, STEP_COLUMN = STEP_KEYS.index("attempt"), STEP_KEYS.index("step")


AGG_KEYS = ("run_id", "attempt", "step", "ranks", "loss_sum", "loss_count", "loss_min",
            "loss_max", "loss_nonfinite", "grad_norm_nonfinite", "samples", "tokens",
            "step_s_max", "t_first", "t_last")


class HotSQL:
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
                select(agents.c.run_id, runs.c.attempt, runs.c.protected, agents.c.role,
                       runs.c.epoch)
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
                self._multi[key] = multi = numbered(multi) if self.raw else multi
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


def numbered(sql: str) -> str:
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


_hot_cache: dict[tuple[str, str], HotSQL] = {}


def hot_sql(conn: Connection) -> HotSQL:
    key = (conn.dialect.name, conn.dialect.driver)
    h = _hot_cache.get(key)
    if h is None:
        h = _hot_cache[key] = HotSQL(conn.dialect)
    return h


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

"""What the live goodput accounting (``supervisor.goodput.live``) reads: the rows a run
gained since the cursors it keeps (ids only grow), so each tick reads only what is new.
Keyword-only functions taking a ``Connection``."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Connection, Text, case, cast, func, literal, or_, select

from supervisor.enums import ActionKind
from supervisor.store.tables import actions, checkpoints, exits, incidents, rank_steps, ranks


def rank_steps_after(conn: Connection, *, run_id: int, after_id: int, limit: int
                     ) -> list[tuple[int, int, int, int, float, float | None, float | None,
                                     float | None]]:
    """(id, attempt, step, rank, t, data_s, compute_s, step_s) of the run's rank step rows
    after ``after_id`` (at most ``limit``, the oldest), grouped by step.

    They come packed, one result row per step: every row a query returns costs the reading
    thread a hand-over of the interpreter lock (the driver releases it per row), and a tick
    of a 16,384-rank run reads 16,384 rows a second, while ingest needs the lock."""
    c = rank_steps.c
    # ``run_id + 0``: no index on run_id may be used, so the planner walks the primary key
    # from the cursor (the rows after it only) instead of every row of the run through
    # ix_rank_steps_run_attempt_step and a sort (SQLite picks that without statistics).
    newest = (select(c.id).where((c.run_id + 0) == run_id, c.id > after_id)
              .order_by(c.id).limit(limit).subquery())
    upto = conn.execute(select(func.max(newest.c.id))).scalar()
    if upto is None:
        return []
    fields = [c.id, c.rank, c.t, c.data_s, c.compute_s, c.step_s]
    if conn.dialect.name == "postgresql":
        packed = func.string_agg(func.concat_ws(
            ":", *[func.coalesce(cast(f, Text), "") for f in fields]), ";")
    else:  # printf %!.17g: the float's exact value as text (CAST and %.17g keep 15-16)
        parts = [cast(c.id, Text), cast(c.rank, Text)] + [
            case((f.is_(None), ""), else_=func.printf("%!.17g", f)) for f in fields[2:]]
        packed = func.group_concat(_joined(parts), ";")
    q = (select(c.attempt, c.step, packed)
         .where((c.run_id + 0) == run_id, c.id > after_id, c.id <= int(upto))
         .group_by(c.attempt, c.step))
    out = []
    for attempt, step, text in conn.execute(q):
        for one in str(text).split(";"):
            i, r, t, d, k, ss = one.split(":")
            out.append((int(i), int(attempt), int(step), int(r), float(t),
                        float(d) if d else None, float(k) if k else None,
                        float(ss) if ss else None))
    out.sort()
    return out


def _joined(parts: list[Any]) -> Any:
    expr = parts[0]
    for p in parts[1:]:
        expr = expr.op("||")(literal(":")).op("||")(p)
    return expr


def rank_count(conn: Connection, *, run_id: int) -> int:
    """How many ranks the run has reported (its world size)."""
    return int(conn.execute(select(func.count()).select_from(ranks)
                            .where(ranks.c.run_id == run_id)).scalar_one())


def checkpoints_after(conn: Connection, *, run_id: int, after_id: int) -> list[dict[str, Any]]:
    c = checkpoints.c
    q = (select(c.id, c.attempt, c.step, c.t, c.complete, c.save_s, c.async_save)
         .where((c.run_id + 0) == run_id, c.id > after_id).order_by(c.id))  # (as above)
    return [dict(r._mapping) for r in conn.execute(q)]


def incidents_after(conn: Connection, *, run_id: int, after_id: int) -> list[dict[str, Any]]:
    """The run's incidents after ``after_id``, each with the time of its agent's exit report
    of the same attempt (``exit_t``; None when the incident has none)."""
    c = incidents.c
    exit_t = (select(func.min(exits.c.t))
              .where(exits.c.run_id == c.run_id, exits.c.agent_id == c.agent_id,
                     exits.c.attempt == c.attempt)
              .scalar_subquery())
    q = (select(c.id, c.kind, c.attempt, c.opened_at, exit_t.label("exit_t"))
         .where(c.run_id == run_id, c.id > after_id).order_by(c.id))
    return [dict(r._mapping) for r in conn.execute(q)]


def restart_actions_after(conn: Connection, *, run_id: int, after_id: int,
                          pending: Collection[int]) -> list[dict[str, Any]]:
    """The run's restart actions after ``after_id`` and those of ``pending`` (not resumed
    when last read)."""
    c = actions.c
    cond = c.id > after_id
    if pending:
        cond = or_(cond, c.id.in_(sorted(pending)))
    q = (select(c.id, c.attempt, c.status, c.created_at, c.rollback_to_step, c.resumed_step,
                c.progress, c.plan)
         .where(c.run_id == run_id, c.kind == ActionKind.RESTART, cond).order_by(c.id))
    return [dict(r._mapping) for r in conn.execute(q)]

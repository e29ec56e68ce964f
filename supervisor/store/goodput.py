"""What the live goodput accounting (``trainwarden.supervisor.goodput.live``) reads: the rows a run
gained since the cursors it keeps (ids only grow), so each tick reads only what is new.
Keyword-only functions taking a ``Connection``."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from sqlalchemy import Connection, Text, case, cast, func, or_, select

from trainwarden.supervisor.enums import ActionKind, PresenceEvent, SupervisorEvent
from trainwarden.supervisor.store.rows import started_at
from trainwarden.supervisor.store.tables import (
    actions,
    agents,
    checkpoints,
    events,
    exits,
    incidents,
    rank_steps,
    ranks,
)

StepGroup = tuple[int, int, float, list[int], list[float], list[float], list[float]]


def rank_step_groups_after(conn: Connection, *, run_id: int, after_id: int, limit: int
                           ) -> tuple[int, list[StepGroup]]:
    """The run's rank step rows after ``after_id`` (at most ``limit``, the oldest), one group
    per step, and the id of the newest row read (``after_id`` when none).

    A group: (attempt, step, newest t, the ranks, their finite-or-not step_s, data_s and
    data_s + compute_s values, NULLs left out).  The values come packed as text, one result
    row per step: every row a query returns costs the reading thread a hand-over of the
    interpreter lock (the driver releases it per row), a tick of a 16,384-rank run reads
    16,384 rows a second, and ingest needs the lock meanwhile."""
    c = rank_steps.c
    # ``run_id + 0``: no index on run_id may be used, so the planner walks the primary key
    # from the cursor (the rows after it only) instead of every row of the run through
    # ix_rank_steps_run_attempt_step and a sort (SQLite picks that without statistics).
    newest = (select(c.id).where((c.run_id + 0) == run_id, c.id > after_id)
              .order_by(c.id).limit(limit).subquery())
    upto = conn.execute(select(func.max(newest.c.id))).scalar()
    if upto is None:
        return after_id, []
    pg = conn.dialect.name == "postgresql"

    def packed(x: Any) -> Any:  # NULLs are left out by both aggregates
        if pg:
            return func.string_agg(cast(x, Text), ",")
        # printf %!.17g: the float's exact value (CAST and %.17g keep 15-16 digits)
        return func.group_concat(case((x.is_(None), None), else_=func.printf("%!.17g", x)),
                                 ",")

    ranks_text = (func.string_agg(cast(c.rank, Text), ",") if pg
                  else func.group_concat(c.rank, ","))
    q = (select(c.attempt, c.step, func.max(c.t), ranks_text, packed(c.step_s),
                packed(c.data_s), packed(c.data_s + c.compute_s))
         .where((c.run_id + 0) == run_id, c.id > after_id, c.id <= int(upto))
         .group_by(c.attempt, c.step).order_by(c.attempt, c.step))
    return int(upto), [
        (int(a), int(s), float(t), _ints(r), _floats(ss), _floats(d), _floats(pre))
        for a, s, t, r, ss, d, pre in conn.execute(q)]


def _ints(text: str | None) -> list[int]:
    return list(map(int, text.split(","))) if text else []


def _floats(text: str | None) -> list[float]:
    return list(map(float, text.split(","))) if text else []


def rank_count(conn: Connection, *, run_id: int) -> int:
    """How many ranks the run has reported (its world size)."""
    return int(conn.execute(select(func.count()).select_from(ranks)
                            .where(ranks.c.run_id == run_id)).scalar_one())


def checkpoints_after(conn: Connection, *, run_id: int, after_id: int) -> list[dict[str, Any]]:
    c = checkpoints.c
    q = (select(c.id, c.attempt, c.step, c.t, c.complete, c.save_s, c.async_save,
                c.stall_s)
         .where((c.run_id + 0) == run_id, c.id > after_id).order_by(c.id))  # (as above)
    return [dict(r._mapping) for r in conn.execute(q)]


def incidents_after(conn: Connection, *, run_id: int, after_id: int) -> list[dict[str, Any]]:
    """The run's incidents after ``after_id``, each with the time of its agent's exit report
    of the same attempt (``exit_t``; None when the incident has none) and when its condition
    began as the detector saw it (``started_at``, ``rows.started_at``; None: not known)."""
    c = incidents.c
    exit_t = (select(func.min(exits.c.t))
              .where(exits.c.run_id == c.run_id, exits.c.agent_id == c.agent_id,
                     exits.c.attempt == c.attempt)
              .scalar_subquery())
    q = (select(c.id, c.kind, c.attempt, c.opened_at, c.details, exit_t.label("exit_t"))
         .where(c.run_id == run_id, c.id > after_id).order_by(c.id))
    out = []
    for r in conn.execute(q):
        row = dict(r._mapping)
        row["started_at"] = started_at(row.pop("details"))
        out.append(row)
    return out


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


def presence_events_after(conn: Connection, *, run_id: int, after_id: int
                          ) -> tuple[int, list[dict[str, Any]]]:
    """(the newest event id of any run, {id, name, t, details} of the run's
    ``PresenceEvent`` and ``requeued`` rows after ``after_id`` up to it): the next read
    starts after the former, so a tick reads only the events new since the last, whichever
    run they are of (the primary key is walked: a run's own events are not indexed by id)."""
    c = events.c
    upto = conn.execute(select(func.max(c.id))).scalar_one()
    if upto is None or upto <= after_id:
        return after_id, []
    q = (select(c.id, c.name, c.t, c.details)
         .where(c.id > after_id, c.id <= upto, (c.run_id + 0) == run_id,
                c.name.in_([*PresenceEvent, SupervisorEvent.REQUEUED]))
         .order_by(c.id))
    return int(upto), [dict(r._mapping) for r in conn.execute(q)]


def newest_heartbeat(conn: Connection, *, run_id: int) -> float | None:
    """When the supervisor last heard from any agent of the run (None: it has none)."""
    v = conn.execute(select(func.max(agents.c.last_seen_at))
                     .where(agents.c.run_id == run_id)).scalar_one()
    return None if v is None else float(v)

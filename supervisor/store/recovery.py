"""Recovery bookkeeping: exits, incidents, audited actions and their commands, and the
checkpoint lineage a restart or rollback resumes from.  Keyword-only functions taking a
``Connection``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Connection, func, literal, select, update

from trainwarden.agent.core.states import CommandStatus, ExitOutcome
from trainwarden.agent.protocol import WorkerEventName
from trainwarden.supervisor.enums import (
    IN_PROGRESS,
    ActionKind,
    ActionStatus,
    IncidentStatus,
    Verdict,
)
from trainwarden.supervisor.store._sql import row
from trainwarden.supervisor.store.rows import (
    ActionRow,
    CheckpointRow,
    ExitRow,
    IncidentRow,
    RestartSpent,
)
from trainwarden.supervisor.store.tables import (
    actions,
    agents,
    checkpoints,
    commands,
    events,
    exits,
    incidents,
    rank_steps,
    step_aggregates,
    step_batches,
)

# ---------------------------------------------------------------------------------------------
# exits


def unhandled_exits(conn: Connection) -> list[ExitRow]:
    q = (
        select(exits, agents.c.node)
        .join(agents, agents.c.id == exits.c.agent_id)
        .where(exits.c.handled.is_(False))
        .order_by(exits.c.id)
    )
    return [cast(ExitRow, row(r)) for r in conn.execute(q)]


def mark_exit(conn: Connection, *, exit_id: int, verdict: Verdict) -> None:
    conn.execute(update(exits).where(exits.c.id == exit_id).values(handled=True, verdict=verdict))


def completed_agents(conn: Connection, *, run_id: int, attempt: int) -> set[int]:
    q = select(exits.c.agent_id).where(exits.c.run_id == run_id, exits.c.attempt == attempt,
                                       exits.c.outcome == ExitOutcome.COMPLETED)
    return {int(r[0]) for r in conn.execute(q)}


# ---------------------------------------------------------------------------------------------
# incidents


def open_incident(conn: Connection, **values: Any) -> int:
    values.setdefault("status", IncidentStatus.OPEN)
    values.setdefault("details", {})
    return int(conn.execute(
        incidents.insert().values(**values).returning(incidents.c.id)
    ).scalar_one())


def resolve_incidents(conn: Connection, *, run_id: int, now: float) -> None:
    """Every open incident of the run is resolved (it resumed, or it completed)."""
    conn.execute(
        update(incidents)
        .where(incidents.c.run_id == run_id, incidents.c.status == IncidentStatus.OPEN)
        .values(status=IncidentStatus.RESOLVED, resolved_at=now)
    )


def resolve_incident(conn: Connection, *, incident_id: int, now: float) -> None:
    conn.execute(update(incidents).where(incidents.c.id == incident_id)
                 .values(status=IncidentStatus.RESOLVED, resolved_at=now, updated_at=now))


def update_incident(conn: Connection, *, incident_id: int, **values: Any) -> None:
    conn.execute(update(incidents).where(incidents.c.id == incident_id).values(**values))


def get_incident(conn: Connection, *, incident_id: int) -> IncidentRow | None:
    r = conn.execute(select(incidents).where(incidents.c.id == incident_id)).first()
    return cast(IncidentRow, row(r)) if r else None


def incidents_of(conn: Connection, *, run_id: int, attempt: int | None = None,
                 kinds: Sequence[str] | None = None, status: str | None = None
                 ) -> list[IncidentRow]:
    cond = [incidents.c.run_id == run_id]
    if attempt is not None:
        cond.append(incidents.c.attempt == attempt)
    if kinds is not None:
        cond.append(incidents.c.kind.in_(list(kinds)))
    if status is not None:
        cond.append(incidents.c.status == status)
    q = select(incidents).where(*cond).order_by(incidents.c.id)
    return [cast(IncidentRow, row(r)) for r in conn.execute(q)]


def incident_for_command(conn: Connection, *, command_id: int) -> int | None:
    """The incident behind the action a command belongs to (None: no incident)."""
    q = (select(actions.c.incident_id).join(commands, commands.c.action_id == actions.c.id)
         .where(commands.c.id == command_id))
    v = conn.execute(q).scalar()
    return None if v is None else int(v)


def insert_event(conn: Connection, **values: Any) -> None:
    """An event of the supervisor's own (a finding worth a row but not an incident)."""
    values.setdefault("details", {})
    values.setdefault("message", "")
    conn.execute(events.insert().values(**values))


# ---------------------------------------------------------------------------------------------
# actions and commands


def create_action(conn: Connection, **values: Any) -> int:
    values.setdefault("progress", {ActionStatus.QUEUED: values["created_at"]})
    values.setdefault("updated_at", values["created_at"])
    return int(conn.execute(
        actions.insert().values(**values).returning(actions.c.id)
    ).scalar_one())


def update_action(conn: Connection, *, action_id: int, **values: Any) -> None:
    conn.execute(update(actions).where(actions.c.id == action_id).values(**values))


def actions_in_progress(conn: Connection) -> list[ActionRow]:
    q = select(actions).where(actions.c.status.in_(list(IN_PROGRESS)))
    return [cast(ActionRow, row(r)) for r in conn.execute(q.order_by(actions.c.id))]


def action_command_statuses(conn: Connection, *, action_id: int) -> list[str]:
    q = select(commands.c.status).where(commands.c.action_id == action_id)
    return [r[0] for r in conn.execute(q)]


def restart_action_for(conn: Connection, *, run_id: int, attempt: int) -> ActionRow | None:
    """The restart action that started ``attempt`` (the newest one, if several)."""
    q = (select(actions).where(actions.c.run_id == run_id,
                               actions.c.kind == ActionKind.RESTART,
                               actions.c.attempt == attempt)
         .order_by(actions.c.id.desc()).limit(1))
    r = conn.execute(q).first()
    return cast(ActionRow, row(r)) if r else None


def restart_history(conn: Connection, *, run_id: int) -> list[RestartSpent]:
    """The run's restart actions, oldest first (each decided one spent budget, even if a
    newer decision superseded it before the agents picked it up)."""
    q = (select(actions.c.cause, actions.c.high_step, actions.c.actor)
         .where(actions.c.run_id == run_id, actions.c.kind == ActionKind.RESTART)
         .order_by(actions.c.id))
    return [cast(RestartSpent, row(r)) for r in conn.execute(q)]


def create_commands(conn: Connection, *, rows: Sequence[dict[str, Any]]) -> None:
    if rows:
        conn.execute(commands.insert(), list(rows))


def agent_commands(conn: Connection, *, agent_id: int) -> list[dict[str, Any]]:
    """The agent's commands still in flight (pending or delivered) and its realign commands
    (the ones with no action), oldest first."""
    c = commands.c
    q = (select(c.id, c.kind, c.attempt, c.status, c.action_id, c.detail, c.created_at,
                c.updated_at)
         .where(c.agent_id == agent_id,
                (c.status.in_([CommandStatus.PENDING, CommandStatus.DELIVERED]))
                | c.action_id.is_(None))
         .order_by(c.id))
    return [dict(r._mapping) for r in conn.execute(q)]


def supersede_commands(conn: Connection, *, run_id: int, now: float) -> None:
    """Unacknowledged commands of a run are dropped when a newer decision replaces them."""
    conn.execute(
        update(commands)
        .where(commands.c.run_id == run_id, commands.c.status == CommandStatus.PENDING)
        .values(status=CommandStatus.SUPERSEDED, updated_at=now)
    )


def max_steps(conn: Connection, *, run_id: int) -> dict[int, int]:
    """attempt -> the highest step it reported (the run's highest step is the largest: what
    the no-progress rule compares restarts by)."""
    a = step_aggregates.c
    q = select(a.attempt, func.max(a.step)).where(a.run_id == run_id).group_by(a.attempt)
    return {int(r[0]): int(r[1]) for r in conn.execute(q)}


# ---------------------------------------------------------------------------------------------
# checkpoint lineage


# "Newest" among checkpoints is by lineage and step, never by the agent's timestamp: the
# current lineage (not abandoned), the highest step, and for a step saved twice the later
# attempt, then the later arrival.  An agent's clock may be off (the supervisor bounds it,
# see ``IngestConfig``, but within the bound a step-1 save may still carry a later time than
# a step-99 one).
def _newest_first(c: Any) -> list[Any]:
    return [c.step.desc(), c.attempt.desc(), c.id.desc()]


def newest_complete_checkpoint(conn: Connection, *, run_id: int) -> CheckpointRow | None:
    """The newest complete checkpoint of the current lineage (never an abandoned one): its
    highest step."""
    q = (
        select(checkpoints)
        .where(checkpoints.c.run_id == run_id, checkpoints.c.complete.is_(True),
               checkpoints.c.abandoned.is_(False))
        .order_by(*_newest_first(checkpoints.c))
        .limit(1)
    )
    r = conn.execute(q).first()
    return cast(CheckpointRow, row(r)) if r else None


def failed_saves_since(conn: Connection, *, run_id: int, t: float | None) -> int:
    """Checkpoint saves the run's workers reported failed (``checkpoint_failed`` events)
    after ``t`` (the newest complete checkpoint's time, None: since the start): the saves in
    a row the run has gone without."""
    e = events.c
    q = select(func.count()).select_from(events).where(
        e.run_id == run_id, e.name == WorkerEventName.CHECKPOINT_FAILED)
    if t is not None:
        q = q.where(e.t > t)
    return int(conn.execute(q).scalar_one())


def lineage_checkpoints(conn: Connection, *, run_id: int) -> list[tuple[int, float, str]]:
    """(step, saved at, path) of the complete checkpoints of the current lineage, lowest step
    first (a step saved twice counts once, with its newest save: the later attempt, then the
    later arrival)."""
    c = checkpoints.c
    q = (select(c.step, c.t, c.path).where(c.run_id == run_id, c.complete.is_(True),
                                           c.abandoned.is_(False))
         .order_by(*reversed(_newest_first(c))))
    by_step = {int(r[0]): (float(r[1]), str(r[2])) for r in conn.execute(q)}
    return [(s, t, p) for s, (t, p) in sorted(by_step.items())]


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
                  step: int | None = None) -> CheckpointRow | None:
    """One checkpoint of a run by id, or the newest save of a step (the later attempt, then
    the later arrival; a save of the current lineage before an abandoned one)."""
    c = checkpoints.c
    q = select(checkpoints).where(c.run_id == run_id)
    if checkpoint_id is not None:
        q = q.where(c.id == checkpoint_id)
    if step is not None:
        q = q.where(c.step == step)
    r = conn.execute(q.order_by(c.abandoned, *_newest_first(c)).limit(1)).first()
    return cast(CheckpointRow, row(r)) if r else None


def batch_indexes(conn: Connection, *, run_id: int, steps: Sequence[int],
                  attempt: int | None = None) -> dict[int, int]:
    """step -> global batch index trained at that step (rank 0, the newest attempt, or only
    ``attempt``): from rank 0's rows, or for a step retention rolled up, from
    ``step_batches``."""
    if not steps:
        return {}
    c, b = rank_steps.c, step_batches.c
    kept = (select(c.attempt, c.step, c.batch_index)
            .where(c.run_id == run_id, c.rank == 0, c.step.in_(list(steps)),
                   c.batch_index.is_not(None)))
    rolled = select(b.attempt, b.step, b.batch_index).where(b.run_id == run_id,
                                                            b.step.in_(list(steps)))
    if attempt is not None:
        kept = kept.where(c.attempt == attempt)
        rolled = rolled.where(b.attempt == attempt)
    found = sorted([*conn.execute(kept), *conn.execute(rolled)], key=lambda r: int(r[0]))
    return {int(r[1]): int(r[2]) for r in found}

"""What the restart anatomy, the checkpoint-interval advice and the MFU diagnosis read
(``trainwarden.supervisor.observability.efficiency`` turns these rows into the pure modules'
inputs).  Read at
request
or scrape time, never by the evaluator's tick.  Keyword-only functions taking a
``Connection``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from typing import Any

from sqlalchemy import Connection, and_, func, or_, select

from trainwarden.agent.core.states import CommandStatus
from trainwarden.agent.protocol import AgentEventName, WorkerEventName
from trainwarden.supervisor.enums import INTERRUPTING, ROLLED_BACK, ActionKind
from trainwarden.supervisor.store import lineage
from trainwarden.supervisor.store.rows import started_at
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
)

CHECKPOINTS_READ = 1000  # the newest complete checkpoints the save cost and interval read
_MILESTONE_EVENTS = (AgentEventName.TORCHRUN_STARTED, WorkerEventName.STARTED,
                     WorkerEventName.PREFLIGHT, WorkerEventName.RESUMED)


def restart_milestones(conn: Connection, *, run_id: int,
                       action_ids: Collection[int] | None = None
                       ) -> dict[int, dict[str, float | None]]:
    """For each restart action of the run (or of ``action_ids``): the times of its
    milestones, as ``trainwarden.supervisor.goodput.anatomy`` names them (None: not recorded).

    * decided: the action's creation;
    * workers_stopped: the newest exit report of the newest attempt with any since the
      previous restart's attempt (every node's workers gone; a crash's may be gone before
      the decision; none when that attempt never ran, as for a restart that superseded
      another before it launched);
    * torchrun_started: the newest ``torchrun_started`` event of the action's attempt (one
      per agent), else the newest time the supervisor received an agent's "done" for the
      action's commands;
    * rendezvous_done: the newest ``worker_started`` event of the attempt (each rank sends
      it once ``init_process_group`` returned);
    * preflight_done: the newest ``preflight`` event of the attempt (each rank sends it when
      its health check ended, or at once when the check is turned off);
    * checkpoint_loaded: the attempt's first ``resumed`` event (rank 0, after the restore);
    * first_step: the time the last rank reported the attempt's first step (its step
      aggregate's ``t_last``), else ``progress["resumed"]``.

    Each is a per-run grouped read or a primary-key lookup per action."""
    ac = actions.c
    # Every restart of the run, filtered here: a run has few, and a long list of ids would
    # be an IN list of as many bound parameters.
    q = (select(ac.id, ac.attempt, ac.created_at, ac.progress)
         .where(ac.run_id == run_id, ac.kind == ActionKind.RESTART).order_by(ac.id))
    wanted = None if action_ids is None else set(action_ids)
    every = [dict(r._mapping) for r in conn.execute(q)]
    acts = [a for a in every if wanted is None or int(a["id"]) in wanted]
    if not acts:
        return {}
    ex = exits.c
    stopped = {int(a): float(t) for a, t in conn.execute(
        select(ex.attempt, func.max(ex.t)).where(ex.run_id == run_id).group_by(ex.attempt))}
    ev = events.c
    marks: dict[tuple[str, int], tuple[float, float]] = {
        (str(n), int(a)): (float(lo), float(hi)) for n, a, lo, hi in conn.execute(
            select(ev.name, ev.attempt, func.min(ev.t), func.max(ev.t))
            .where(ev.run_id == run_id, ev.name.in_(_MILESTONE_EVENTS))
            .group_by(ev.name, ev.attempt))}
    cm = commands.c
    done = {int(i): float(t) for i, t in conn.execute(
        select(cm.action_id, func.max(cm.updated_at))
        .where(cm.run_id == run_id, cm.action_id.is_not(None),
               cm.status == CommandStatus.DONE)
        .group_by(cm.action_id))}
    sa = step_aggregates.c
    out: dict[int, dict[str, float | None]] = {}
    # The attempt of the restart before each one: the workers a restart stopped ran as an
    # attempt since then (an older attempt's exits belong to an older restart).
    chain = [0, *(int(a["attempt"]) for a in every)]
    previous = {new: old for old, new in itertools.pairwise(chain)}
    for a in acts:
        aid, attempt = int(a["id"]), int(a["attempt"])
        progress = a["progress"] if isinstance(a["progress"], dict) else {}
        since = previous.get(attempt, 0)
        earlier = [k for k in stopped if since <= k < attempt]
        launched = marks.get((AgentEventName.TORCHRUN_STARTED, attempt))
        rdzv = marks.get((WorkerEventName.STARTED, attempt))
        checked = marks.get((WorkerEventName.PREFLIGHT, attempt))
        resumed = marks.get((WorkerEventName.RESUMED, attempt))
        first = conn.execute(
            select(sa.t_last).where(sa.run_id == run_id, sa.attempt == attempt)
            .order_by(sa.step).limit(1)).scalar()
        if first is None and isinstance(progress.get("resumed"), int | float):
            first = progress["resumed"]
        times = {
            "decided": float(a["created_at"]),
            "workers_stopped": stopped[max(earlier)] if earlier else None,
            "torchrun_started": launched[1] if launched else done.get(aid),
            "rendezvous_done": rdzv[1] if rdzv else None,
            "preflight_done": checked[1] if checked else None,
            "checkpoint_loaded": resumed[0] if resumed else None,
            "first_step": None if first is None else float(first),
        }
        # A time no clock gives (a row written around the ingest checks) is not recorded.
        out[aid] = {k: v if v is not None and math.isfinite(v) else None
                    for k, v in times.items()}
    return out


def restart_faults(conn: Connection, *, run_id: int) -> dict[int, float]:
    """Restart action id -> when the fault behind it happened: the exit report of the
    incident's agent and attempt, else when the incident's condition began (``started_at``:
    a loss spike's first step), else the incident's opening (restarts without an incident,
    an operator's, are left out)."""
    ac, i, ex = actions.c, incidents.c, exits.c
    exit_t = (select(func.min(ex.t))
              .where(ex.run_id == i.run_id, ex.agent_id == i.agent_id, ex.attempt == i.attempt)
              .scalar_subquery())
    q = (select(ac.id, i.opened_at, i.details, exit_t.label("exit_t"))
         .select_from(actions.join(incidents, incidents.c.id == ac.incident_id))
         .where(ac.run_id == run_id, ac.kind == ActionKind.RESTART))
    out = {}
    for aid, opened, details, et in conn.execute(q):
        began = started_at(details)
        t = float(et if et is not None else began if began is not None else opened)
        if math.isfinite(t):
            out[int(aid)] = t
    return out


def failure_count(conn: Connection, *, run_id: int) -> int:
    """The run's incidents that interrupted training
    (``trainwarden.supervisor.enums.INTERRUPTING``), and those of its loss spikes and NaNs
    that were rolled back (a restart action answers them: the work since the checkpoint is
    lost as to a crash)."""
    i = incidents.c
    rolled = select(actions.c.incident_id).where(actions.c.run_id == run_id,
                                                 actions.c.kind == ActionKind.RESTART,
                                                 actions.c.incident_id.is_not(None))
    return int(conn.execute(select(func.count()).select_from(incidents).where(
        i.run_id == run_id,
        or_(i.kind.in_(sorted(INTERRUPTING)),
            and_(i.kind.in_(sorted(ROLLED_BACK)), i.id.in_(rolled))))).scalar_one())


def node_count(conn: Connection, *, run_id: int) -> int:
    return int(conn.execute(select(func.count()).select_from(agents)
                            .where(agents.c.run_id == run_id)).scalar_one())


def complete_checkpoints(conn: Connection, *, run_id: int, limit: int = CHECKPOINTS_READ
                         ) -> list[dict[str, Any]]:
    """{attempt, t, save_s, async_save, stall_s} of the run's newest complete checkpoints, oldest
    first (abandoned ones included: their saves stalled training all the same)."""
    c = checkpoints.c
    q = (select(c.attempt, c.t, c.save_s, c.async_save, c.stall_s)
         .where(c.run_id == run_id, c.complete.is_(True)).order_by(c.t.desc()).limit(limit))
    return [dict(r._mapping) for r in reversed(conn.execute(q).all())]


def rank_phase_means(conn: Connection, *, run_id: int, attempt: int, step_from: int,
                     step_to: int) -> list[tuple[int, float | None, float | None, float | None]]:
    """(rank, mean data_s, mean compute_s, mean step_s) per rank over the attempt's steps
    ``step_from..step_to`` (each mean over the reports that carry it; None when none do)."""
    c = rank_steps.c
    q = (select(c.rank, func.avg(c.data_s), func.avg(c.compute_s), func.avg(c.step_s))
         .where(c.run_id == run_id, c.attempt == attempt, c.step >= step_from,
                c.step <= step_to)
         .group_by(c.rank).order_by(c.rank))
    return [(int(r), None if d is None else float(d), None if k is None else float(k),
             None if s is None else float(s)) for r, d, k, s in conn.execute(q)]


ELASTIC_STEPS_READ = 50  # the newest steps whose time a shrink-or-wait choice reads


def elastic_figures(conn: Connection, *, run_id: int) -> dict[str, float | None]:
    """The run's figures a choice between shrinking and waiting reads (None: not measured):
    ``step_s``, the median of its final lineage's newest steps' time (the slowest rank's);
    ``restart_s``, the mean decision-to-first-step time of its restarts that reached a first
    step;
    ``interval_s``, the mean time between two consecutive complete checkpoints of one
    attempt."""
    sa = step_aggregates.c
    kept = lineage.condition(lineage.run_cuts(conn, run_id=run_id), sa.attempt, sa.step)
    times = sorted(float(t) for (t,) in conn.execute(
        select(sa.step_s_max).where(sa.run_id == run_id, kept, sa.step_s_max.is_not(None))
        .order_by(sa.t_last.desc()).limit(ELASTIC_STEPS_READ)) if math.isfinite(float(t)))
    step_s = times[len(times) // 2] if times else None
    restarts = [m["first_step"] - m["decided"]
                for m in restart_milestones(conn, run_id=run_id).values()
                if m["first_step"] is not None and m["decided"] is not None
                and m["first_step"] >= m["decided"]]
    ckpts = complete_checkpoints(conn, run_id=run_id)
    gaps = [float(b["t"]) - float(a["t"]) for a, b in itertools.pairwise(ckpts)
            if a["attempt"] == b["attempt"] and b["t"] > a["t"]]
    return {"step_s": step_s,
            "restart_s": sum(restarts) / len(restarts) if restarts else None,
            "interval_s": sum(gaps) / len(gaps) if gaps else None}

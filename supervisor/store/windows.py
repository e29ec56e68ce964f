"""Windows of measurements the detectors judge (what
``trainwarden.supervisor.control.detection`` reads every
tick): progress, step times, per-rank timings, losses, worker events.  Keyword-only functions
taking a ``Connection``; the hot ones are built from plain tuples."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from sqlalchemy import Connection, func, select

from trainwarden.agent.core.states import NodeRole
from trainwarden.supervisor.store import lineage
from trainwarden.supervisor.store._sql import row
from trainwarden.supervisor.store.rows import (
    AgentLiveness,
    EventRow,
    LossRow,
    NodeEventRow,
    RankProgressRow,
)
from trainwarden.supervisor.store.tables import (
    agents,
    checkpoints,
    events,
    rank_steps,
    ranks,
    step_aggregates,
)


def agent_liveness(conn: Connection, *, run_id: int) -> list[AgentLiveness]:
    """What the detectors need of each member agent (no JSON health columns: read every
    tick).  A spare runs nothing: no detector judges it (a silent spare only leaves the
    pool of free spares)."""
    a = agents.c
    q = (select(a.id, a.node, a.state, a.last_seen_at, a.disk_free_bytes, a.disk_total_bytes)
         .where(a.run_id == run_id, a.role == NodeRole.MEMBER).order_by(a.id))
    return [{"id": i, "node": n, "state": st, "last_seen_at": t, "disk_free_bytes": f,
             "disk_total_bytes": tot} for i, n, st, t, f, tot in conn.execute(q)]


def rank_progress(conn: Connection, *, run_id: int, attempt: int) -> list[RankProgressRow]:
    """Each rank's newest step of ``attempt`` with its node."""
    q = (select(ranks.c.rank, ranks.c.step, ranks.c.t, agents.c.node)
         .join(agents, agents.c.id == ranks.c.agent_id)
         .where(ranks.c.run_id == run_id, ranks.c.attempt == attempt))
    # Read every tick for every rank (16,384 rows for a big run): plain tuples, no mappings.
    return [{"rank": r, "step": s, "t": t, "node": n}
            for r, s, t, n in conn.execute(q)]


def rank_progress_lagging(conn: Connection, *, run_id: int, attempt: int, lag_steps: int
                          ) -> list[RankProgressRow]:
    """What the hang judgment needs of a healthy attempt: the ranks more than ``lag_steps``
    behind the newest step, plus a rank at the newest step and the rank with the newest
    report time (so the newest step and time are those of all ranks).  A few rows instead of
    one per rank: every row a query returns costs the reading thread a hand-over of the
    interpreter lock, and a big run has 16,384 ranks read every tick."""
    r, a = ranks.c, agents.c
    cols = (r.rank, r.step, r.t, a.node)
    base = (select(*cols).join(agents, a.id == r.agent_id)
            .where(r.run_id == run_id, r.attempt == attempt))
    top_step = conn.execute(base.order_by(r.step.desc(), r.rank).limit(1)).first()
    if top_step is None:
        return []
    top_t = conn.execute(base.order_by(r.t.desc(), r.rank).limit(1)).first()
    behind = conn.execute(base.where(r.step < int(top_step[1]) - lag_steps)).all()
    picked = {int(x[0]): x for x in [*behind, top_step, *([top_t] if top_t else [])]}
    return [{"rank": k, "step": s, "t": t, "node": n} for k, (_, s, t, n) in picked.items()]


def rank_nodes(conn: Connection, *, run_id: int) -> dict[int, str]:
    """Each rank's node (from its latest report)."""
    q = (select(ranks.c.rank, agents.c.node).join(agents, agents.c.id == ranks.c.agent_id)
         .where(ranks.c.run_id == run_id))
    return {int(r[0]): str(r[1]) for r in conn.execute(q)}


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


def step_range(conn: Connection, *, run_id: int, attempt: int) -> tuple[int, int] | None:
    """(first, newest) step of an attempt, None before its first step report."""
    a = step_aggregates.c
    q = select(func.min(a.step), func.max(a.step)).where(a.run_id == run_id,
                                                          a.attempt == attempt)
    lo, hi = conn.execute(q).one()
    return None if lo is None else (int(lo), int(hi))


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


def loss_series(conn: Connection, *, run_id: int, attempt: int, limit: int) -> list[LossRow]:
    """The newest ``limit`` steps of the run's final lineage (``store.lineage``) once
    ``attempt`` reported a step (nothing before: a new attempt is judged on its own steps),
    oldest first.  Loss mean, NaN/Inf counts, samples and times per step."""
    a = step_aggregates.c
    if step_range(conn, run_id=run_id, attempt=attempt) is None:
        return []
    kept = lineage.condition(lineage.run_cuts(conn, run_id=run_id), a.attempt, a.step)
    q = (select(a.attempt, a.step, a.loss_sum, a.loss_count, a.loss_nonfinite,
                a.grad_norm_nonfinite, a.samples, a.tokens, a.t_first, a.t_last)
         .where(a.run_id == run_id, kept)
         .order_by(a.step.desc(), a.attempt.desc()).limit(limit))
    by_step: dict[int, dict[str, Any]] = {}
    for r in conn.execute(q):
        d = row(r)
        # (an attempt newer than the cuts read is on the lineage too: the newest wins)
        by_step.setdefault(int(d["step"]), d)
    rows = [by_step[k] for k in sorted(by_step)]
    for d in rows:
        n = int(d["loss_count"] or 0)
        d["loss"] = (d["loss_sum"] / n) if n and d["loss_sum"] is not None else None
    return cast(list[LossRow], rows)


def events_after(conn: Connection, *, after_id: int, names: Sequence[str], limit: int = 1000
                 ) -> list[NodeEventRow]:
    """Events named ``names`` stored after ``after_id`` (any run), in id order, with the
    node of the agent that sent it and whether that agent is trusted for its host."""
    q = (select(events, agents.c.node, agents.c.host_trusted)
         .outerjoin(agents, agents.c.id == events.c.agent_id)
         .where(events.c.id > after_id, events.c.name.in_(list(names)))
         .order_by(events.c.id).limit(limit))
    return [cast(NodeEventRow, row(r)) for r in conn.execute(q)]


def ranks_with_event(conn: Connection, *, run_id: int, attempt: int, name: str
                     ) -> frozenset[int]:
    q = (select(events.c.rank).distinct()
         .where(events.c.run_id == run_id, events.c.attempt == attempt, events.c.name == name,
                events.c.rank.is_not(None)))
    return frozenset(int(r[0]) for r in conn.execute(q))


def latest_event(conn: Connection, *, run_id: int, attempt: int, name: str
                 ) -> EventRow | None:
    q = (select(events).where(events.c.run_id == run_id, events.c.attempt == attempt,
                              events.c.name == name)
         .order_by(events.c.id.desc()).limit(1))
    r = conn.execute(q).first()
    return cast(EventRow, row(r)) if r else None


def latest_run_event(conn: Connection, *, run_id: int, name: str) -> EventRow | None:
    """The run's newest event named ``name``, of any attempt."""
    q = (select(events).where(events.c.run_id == run_id, events.c.name == name)
         .order_by(events.c.id.desc()).limit(1))
    r = conn.execute(q).first()
    return cast(EventRow, row(r)) if r else None


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

"""What the API, the dashboard and the metrics collector read.  Keyword-only functions taking
a ``Connection``."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

from sqlalchemy import Connection, Select, Table, func, literal, or_, select

from trainwarden.agent.protocol import WorkerEventName
from trainwarden.supervisor.contract.limits import BASELINE_PER_DEVICE_MAX
from trainwarden.supervisor.enums import ActionKind, IncidentKind, IncidentStatus, SupervisorEvent
from trainwarden.supervisor.store import lineage
from trainwarden.supervisor.store._sql import row, with_specials
from trainwarden.supervisor.store.health import number
from trainwarden.supervisor.store.rows import (
    ActionRow,
    CheckpointRow,
    EventRow,
    IncidentRow,
    RestartRow,
    StepAggregateRow,
    Throughput,
)
from trainwarden.supervisor.store.tables import (
    actions,
    agents,
    checkpoints,
    events,
    incidents,
    ranks,
    runs,
    step_aggregates,
)


def ping(conn: Connection) -> None:
    """A database round trip (the health check)."""
    conn.execute(select(literal(1)))


def newest_step(conn: Connection, *, run_id: int, attempt: int | None = None
                ) -> StepAggregateRow | None:
    """The newest step aggregate of ``attempt``, or without one the newest of the run's final
    lineage (``store.lineage``: while a rollback is under way, the newest step before the
    point it goes back to); None before the first step report."""
    a = step_aggregates.c
    if attempt is not None:
        r = conn.execute(select(step_aggregates).where(a.run_id == run_id, a.attempt == attempt)
                         .order_by(a.step.desc()).limit(1)).first()
        return cast(StepAggregateRow, row(r)) if r else None
    # Newest attempt first, each below its cut: a primary-key seek per attempt tried.
    for att, cut in sorted(lineage.run_cuts(conn, run_id=run_id).items(), reverse=True):
        q = select(step_aggregates).where(a.run_id == run_id, a.attempt == att)
        if cut is not None:
            q = q.where(a.step < cut)
        r = conn.execute(q.order_by(a.step.desc()).limit(1)).first()
        if r:
            return cast(StepAggregateRow, row(r))
    return None


def newest_report_time(conn: Connection, *, run_id: int) -> float | None:
    """When the newest attempt that reported a step completed its newest one (on the
    lineage or not: the time training last made a step), None before any."""
    a = step_aggregates.c
    v = conn.execute(select(a.t_last).where(a.run_id == run_id)
                     .order_by(a.attempt.desc(), a.step.desc()).limit(1)).scalar()
    return None if v is None else float(v)


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


def throughput(conn: Connection, *, run_id: int, attempt: int, window: int = 20) -> Throughput:
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
    out: Throughput = {"steps_per_s": None, "samples_per_s": None, "tokens_per_s": None,
                       "ranks": max((int(r.ranks) for r in rows), default=None)}
    if len(rows) < 2:
        return out
    span = rows[0].t_last - rows[-1].t_last
    if not (math.isfinite(span) and span > 0):  # (times no clock gives: no rate)
        return out
    newer = rows[:-1]  # the oldest row only marks the start of the span
    def rate(v: float) -> float | None:
        return v if math.isfinite(v) else None

    out["steps_per_s"] = rate(len(newer) / span)
    out["samples_per_s"] = rate(sum(r.samples for r in newer) / span)
    out["tokens_per_s"] = rate(sum(r.tokens for r in newer) / span)
    return out


def steps(
    conn: Connection,
    *,
    run_id: int,
    step_from: int | None,
    step_to: int | None,
    max_points: int,
    attempt: int | None = None,
) -> dict[str, list[dict[str, Any]]]:
    """Per-step aggregates, bucketed by step range on the server when there are more than
    ``max_points`` of them (each bucket: loss min/max/mean, sums, worst step time).

    ``points``: the run's final lineage (``store.lineage``), one attempt's row per step;
    ``superseded``: the rows off it (an old attempt's steps a restart trained again or threw
    away), bucketed per attempt, to be shown apart.  With ``attempt``: that attempt's own
    rows as ``points``, on the lineage or not, and no ``superseded``."""
    a = step_aggregates.c
    cond = [a.run_id == run_id]
    if step_from is not None:
        cond.append(a.step >= step_from)
    if step_to is not None:
        cond.append(a.step <= step_to)
    if attempt is not None:
        return {"points": _series(conn, [*cond, a.attempt == attempt], max_points),
                "superseded": []}
    cuts = lineage.run_cuts(conn, run_id=run_id)
    off = lineage.superseded(cuts, a.attempt, a.step)
    return {"points": _series(conn, [*cond, lineage.condition(cuts, a.attempt, a.step)],
                              max_points),
            "superseded": [] if off is None else _series(conn, [*cond, off], max_points,
                                                         per_attempt=True)}


def _series(conn: Connection, cond: list[Any], max_points: int, per_attempt: bool = False
            ) -> list[dict[str, Any]]:
    """The step aggregates matching ``cond``, one point per row up to ``max_points`` rows,
    else bucketed by step range (per attempt with ``per_attempt``: buckets never mix
    attempts; else ``cond`` must hold one row per step)."""
    a = step_aggregates.c
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
            d = row(r)
            out.append(_point(
                step_from=d["step"], step_to=d["step"], attempt=d["attempt"], rows=1,
                ranks=d["ranks"], loss_sum=d["loss_sum"], loss_count=d["loss_count"],
                loss_min=d["loss_min"], loss_max=d["loss_max"],
                loss_nonfinite=d["loss_nonfinite"], grad_norm_nonfinite=d["grad_norm_nonfinite"],
                samples=d["samples"], tokens=d["tokens"], step_s_max=d["step_s_max"],
                t=d["t_last"],
            ))
        return out
    # (more rows than steps, per attempt: wide enough that the points stay near max_points)
    width = max(1, math.ceil((hi - lo + 1) / max_points), math.ceil(n / max_points))
    bucket = ((a.step - lo) // width).label("bucket")  # floor division on both backends
    keys = [a.attempt, bucket] if per_attempt else [bucket]
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
        .group_by(*keys)
        .order_by(bucket, *keys[:-1])
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


def rank_latest(conn: Connection, *, run_id: int) -> list[dict[str, Any]]:
    """Each rank's latest report (NaN/Inf restored) with its node."""
    q = (
        select(ranks, agents.c.node)
        .join(agents, agents.c.id == ranks.c.agent_id)
        .where(ranks.c.run_id == run_id)
        .order_by(ranks.c.rank)
    )
    return [with_specials(row(r)) for r in conn.execute(q)]


def _list(conn: Connection, table: Table, run_id: int, order: Iterable[Any], limit: int
          ) -> list[Any]:
    q = select(table).where(table.c.run_id == run_id).order_by(*order).limit(limit)
    return [row(r) for r in conn.execute(q)]


def list_checkpoints(conn: Connection, *, run_id: int, limit: int = 1000) -> list[CheckpointRow]:
    """Newest first: by step, then attempt, then arrival (never by the agent's clock)."""
    c = checkpoints.c
    return _list(conn, checkpoints, run_id, [c.step.desc(), c.attempt.desc(), c.id.desc()],
                 limit)


def list_incidents(conn: Connection, *, run_id: int, limit: int = 1000) -> list[IncidentRow]:
    """Newest first."""
    return _list(conn, incidents, run_id, [incidents.c.id.desc()], limit)


def list_actions(conn: Connection, *, run_id: int, limit: int = 1000) -> list[ActionRow]:
    """Newest first."""
    return _list(conn, actions, run_id, [actions.c.id.desc()], limit)


def list_events(conn: Connection, *, run_id: int, limit: int = 1000) -> list[EventRow]:
    """Newest first."""
    return _list(conn, events, run_id, [events.c.t.desc(), events.c.id.desc()], limit)


def open_incident_counts(conn: Connection, *, run_id: int) -> dict[str, int]:
    i = incidents.c
    q = (select(i.kind, func.count()).where(i.run_id == run_id, i.status == IncidentStatus.OPEN)
         .group_by(i.kind))
    return {str(r[0]): int(r[1]) for r in conn.execute(q)}


def restart_actions(conn: Connection, *, run_id: int) -> list[RestartRow]:
    """Every restart-like action of a run with the kind of the incident behind it (if any)."""
    ac = actions.c
    q = (
        select(ac.id, ac.kind, ac.actor, ac.status, ac.attempt, ac.resumed_step,
               ac.created_at, ac.cause, incidents.c.kind.label("incident_kind"))
        .select_from(actions.outerjoin(incidents, incidents.c.id == ac.incident_id))
        .where(ac.run_id == run_id, ac.kind == ActionKind.RESTART)
        .order_by(ac.id)
    )
    return [cast(RestartRow, row(r)) for r in conn.execute(q)]


def flops_declaration(conn: Connection, *, run_id: int) -> dict[str, Any] | None:
    """The details of the run's newest ``flops_declared`` event (for MFU), or None."""
    q = (select(events.c.details).where(events.c.run_id == run_id,
                                         events.c.name == WorkerEventName.FLOPS_DECLARED)
         .order_by(events.c.id.desc()).limit(1))
    d = conn.execute(q).scalar()
    if not isinstance(d, dict):
        return None
    # The declared figures only, each a positive finite number or None; without a peak and
    # one of the FLOPs figures there is no declaration to show.
    out = {k: v if (v := number(d.get(k))) is not None and v > 0 else None
           for k in ("peak_flops_per_rank", "flops_per_sample", "flops_per_token")}
    if out["peak_flops_per_rank"] is None or (out["flops_per_sample"] is None
                                              and out["flops_per_token"] is None):
        return None
    # Optional: one device's throughput alone (for scaling efficiency), in the unit of the
    # FLOPs figure; out of bounds reads as not declared.
    base = number(d.get("baseline_per_device"))
    out["baseline_per_device"] = (base if base is not None
                                  and 0 < base <= BASELINE_PER_DEVICE_MAX else None)
    return out


def run_fingerprint(conn: Connection, *, run_id: int, live_since: float | None = None
                    ) -> tuple[Any, ...]:
    """Cheap summary that changes whenever what the dashboard shows of a run changes (except
    the agents' last-seen times, which move with every batch: only whether each was heard
    from since ``live_since``, the node-lost deadline ago, which makes it lost or not)."""
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
    live = (ag.last_seen_at >= live_since) if live_since is not None else literal(True)
    agt = conn.execute(
        select(ag.id, ag.state, ag.attempt, ag.disk_free_bytes, ag.dropped, ag.role, live)
        .where(ag.run_id == run_id).order_by(ag.id)
    ).all()
    return (tuple(run), tuple(last) if last else None, tuple(inc), tuple(act), tuple(ckpt),
            tuple(tuple(r) for r in agt))


def get_action(conn: Connection, *, action_id: int) -> ActionRow | None:
    r = conn.execute(select(actions).where(actions.c.id == action_id)).first()
    return cast(ActionRow, row(r)) if r else None


def replaced_nodes(conn: Connection, *, run_id: int) -> set[str]:
    """The nodes of the run whose node rank membership gave to another node, or that a
    shrink left out (its ``membership_changed`` and ``world_resized`` records)."""
    out: set[str] = set()
    q = select(events.c.name, events.c.details).where(
        events.c.run_id == run_id,
        events.c.name.in_([SupervisorEvent.MEMBERSHIP_CHANGED, SupervisorEvent.WORLD_RESIZED]))
    for name, details in conn.execute(q):
        key, field = (("replaced", "old") if name == SupervisorEvent.MEMBERSHIP_CHANGED
                      else ("dropped", "node"))
        entries = (details or {}).get(key) if isinstance(details, dict) else None
        for e in entries if isinstance(entries, list) else []:
            node = e.get(field) if isinstance(e, dict) else None
            if isinstance(node, str):
                out.add(node)
    return out


def lost_nodes(conn: Connection, *, run_id: int) -> dict[str, float]:
    """node -> when an open node-lost incident of the run named it."""
    q = (select(incidents.c.node, func.max(incidents.c.opened_at))
         .where(incidents.c.run_id == run_id, incidents.c.kind == IncidentKind.NODE_LOST,
                incidents.c.status == IncidentStatus.OPEN, incidents.c.node.is_not(None))
         .group_by(incidents.c.node))
    return {str(node): float(t) for node, t in conn.execute(q)}

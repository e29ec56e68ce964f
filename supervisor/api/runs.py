"""Run routes: status and history reads, and the operator's restart/stop."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request, status
from pydantic import BaseModel, Field, field_validator, model_validator

from trainwarden.agent.core import rootcause
from trainwarden.supervisor.api.checkpoint_ref import checkpoint_id, known_checkpoint, no_path
from trainwarden.supervisor.api.deps import (
    DB,
    ClockDep,
    OperatorAuth,
    ReadAuth,
    Settings,
    Straggler,
    can_read,
)
from trainwarden.supervisor.api.errors import ERROR_RESPONSES
from trainwarden.supervisor.api.responses import (
    ActionList,
    CheckpointList,
    EventList,
    GoodputSeries,
    IncidentList,
    OperatorDecision,
    RankList,
    RankRollups,
    RunDetail,
    RunList,
    StepSeries,
    documented,
)
from trainwarden.supervisor.contract.limits import U31, RunName, Text, text
from trainwarden.supervisor.control import actions, detection, policy
from trainwarden.supervisor.control.membership import Capacity
from trainwarden.supervisor.control.node_views import condition_of, node_views
from trainwarden.supervisor.observability import efficiency
from trainwarden.supervisor.store import reads, registry
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import retention as retention_store
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import RunRow

# response_model=None: the routes return plain dicts, rendered by SafeJSONResponse so that
# a NaN loss reads "NaN" (a pydantic response model would turn it into null).
# Their answers are declared by ``responses=`` (``trainwarden.supervisor.api.responses``) instead.
router = APIRouter(tags=["runs"], responses=ERROR_RESPONSES)


def _run_or_404(conn: Connection, name: str) -> RunRow:
    run = registry.get_run_by_name(conn, name=name)
    if run is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown run {name!r}")
    return run


def _membership(c: Capacity) -> dict[str, Any]:
    return {"nnodes": c.nnodes, "epoch": c.epoch, "spares": c.spares,
            "spares_configured": c.spares_configured, "missing": list(c.missing),
            "missing_count": c.waiting, "world": c.world, "min_nodes": c.min_nodes}


_AGENT_FIELDS = ("id", "node", "hostname", "attempt", "last_seen_at", "disk_free_bytes",
                 "disk_total_bytes", "workers", "gpus", "dropped", "role", "node_rank",
                 "joined_as", "address", "nproc_per_node", "devices")


def _agents(conn: Connection, run: RunRow, now: float, live_s: float, cap: Capacity
            ) -> list[dict[str, Any]]:
    """Each node with its state (``node_states``: the one the CLI and the dashboard show)."""
    agents = registry.run_agents(conn, run_id=run["id"])
    views = node_views(conn, run=run, agents=agents, now=now, live_s=live_s, capacity=cap)
    out = []
    for a in agents:
        v = views[int(a["id"])]
        row: dict[str, Any] = dict(a)
        out.append({**{k: row[k] for k in _AGENT_FIELDS}, "state": v.state,
                    "reported_state": a["state"], "seen_s": round(v.seen_s, 3),
                    "readings_stale": v.stale})
    return out


def _summary(conn: Connection, run: RunRow, now: float, live_s: float) -> dict[str, Any]:
    last = reads.newest_step(conn, run_id=run["id"], attempt=run["attempt"])
    ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
    restarts = efficiency.restart_counts(conn, int(run["id"]))
    cap = actions.capacity(conn, run_id=int(run["id"]), now=now, live_s=live_s)
    return {
        "id": run["id"],
        "name": run["name"],
        "uuid": run["uuid"],  # the supervisor's identity of the run (a reused name differs)
        "status": run["status"],
        "reason": run["reason"],
        "attempt": run["attempt"],
        "restarts": restarts.total,
        "restarts_by_cause": dict(restarts.by_cause),
        "step": last["step"] if last else None,
        "step_at": last["t_last"] if last else None,
        "throughput": reads.throughput(conn, run_id=run["id"], attempt=run["attempt"]),
        "checkpoint": (
            {k: ckpt[k] for k in ("step", "path", "bytes", "attempt", "lineage", "t")}
            if ckpt else None
        ),
        # Kept by the workers' retention besides the newest few (pinned by the agents).
        "protected": list(run["protected"] or []),
        "agents": _agents(conn, run, now, live_s, cap),
        "membership": _membership(cap),
        "condition": (c.as_dict() if (c := condition_of(conn, run=run)) is not None else None),
        "created_at": run["created_at"],
        "updated_at": run["updated_at"],
    }


@router.get("/runs", response_model=None, responses=documented(RunList))
def list_runs(db: DB, request: Request, auth: ReadAuth, clock: ClockDep,
              settings: Settings) -> dict[str, Any]:
    """Every run the token may read (a scoped token: the runs of its scope)."""
    now, live_s = clock(), settings.node_lost.deadline_s
    with db.read() as conn:
        return {"runs": [_summary(conn, r, now, live_s) for r in registry.list_runs(conn)
                         if can_read(request, auth, str(r["name"]))]}


@router.get("/runs/{run}", response_model=None, responses=documented(RunDetail))
def get_run(run: RunName, db: DB, request: Request, clock: ClockDep,
            _auth: ReadAuth, settings: Settings) -> dict[str, Any]:
    """Status, attempt, newest step, throughput, restarts, newest complete checkpoint;
    ``goodput``: the live ETTR with the badput by cause in seconds (null before the
    evaluator accounted the run; a cause it cannot measure is null, with the reason in
    ``not_measured``); ``last_restart``: the newest restart action's id, attempt, status and
    ``anatomy`` (seconds per phase, null where a milestone is missing; null before the first
    restart); ``checkpoint_interval``: the recommended checkpoint interval, the current one,
    the expected ETTR at each and the inputs used (``state`` "not_enough_data" with what is
    ``missing``); ``mfu``: the run's MFU, its band and what it usually means, each rank's
    shares of the step and MFU, and the scaling diagnosis (null before the first step)."""
    with db.read() as conn:
        r = _run_or_404(conn, run)
        out = _summary(conn, r, clock(), settings.node_lost.deadline_s)
        restarts = reads.restart_actions(conn, run_id=r["id"])
        last = restarts[-1] if restarts else None
        an = (efficiency.restart_anatomies(conn, r["id"], [last["id"]]).get(last["id"])
              if last is not None else None)
        out["last_restart"] = ({"action_id": last["id"], "attempt": last["attempt"],
                                "status": last["status"],
                                "anatomy": an.as_dict() if an is not None else None}
                               if last is not None else None)
        out["checkpoint_interval"] = efficiency.interval_advice(conn, r, clock())
        out["mfu"] = efficiency.mfu_report(conn, r)
    evaluator = getattr(request.app.state, "evaluator", None)
    out["goodput"] = evaluator.goodput(int(out["id"])) if evaluator is not None else None
    return out


@router.get("/runs/{run}/goodput", response_model=None, responses=documented(GoodputSeries))
def get_goodput(
    run: RunName, db: DB, request: Request, _auth: ReadAuth,
    window_s: Annotated[float, Query(gt=0, le=86_400)] = 6 * 3600.0,
) -> dict[str, Any]:
    """The live goodput: ``current`` (as on the run), ``window`` (the ETTR and badput of
    the last ``window_s`` seconds: its ``start``/``end`` say the span it covers, shorter
    while the run or the series is younger; a restore inside it charges the steps it threw
    away, so its productive time can be negative), and ``points``: the cumulative breakdown
    once a minute over the last day.  404 for an unknown run; ``current`` null before the
    evaluator accounted it."""
    with db.read() as conn:
        r = _run_or_404(conn, run)
    evaluator = getattr(request.app.state, "evaluator", None)
    series = evaluator.goodput_series(int(r["id"]), window_s) if evaluator else None
    return {"run": run, "window_s": window_s,
            **(series or {"current": None, "window": None, "points": []})}


@router.get("/runs/{run}/steps", response_model=None, responses=documented(StepSeries))
def get_steps(
    run: RunName,
    db: DB,
    _auth: ReadAuth,
    step_from: Annotated[U31 | None, Query(alias="from")] = None,
    step_to: Annotated[U31 | None, Query(alias="to")] = None,
    max_points: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    attempt: Annotated[U31 | None, Query()] = None,
) -> dict[str, Any]:
    """Per-step aggregates; above ``max_points`` steps they are bucketed by step range (each
    point: step_from..step_to, loss min/max/mean over finite values, NaN/Inf counts, sums).
    ``points``: the final lineage, one attempt's row per step (after a restart, the steps it
    trained again are the new attempt's); ``superseded``: the older attempts' rows off it,
    per attempt.  With ``attempt``: that attempt's own steps."""
    if step_from is not None and step_to is not None and step_to < step_from:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"'to' ({step_to}) is below 'from' ({step_from})")
    with db.read() as conn:
        r = _run_or_404(conn, run)
        series = reads.steps(conn, run_id=r["id"], step_from=step_from, step_to=step_to,
                             max_points=max_points, attempt=attempt)
    return {"run": run, **series}


@router.get("/runs/{run}/ranks", response_model=None, responses=documented(RankList))
def get_ranks(run: RunName, db: DB, straggler: Straggler, _auth: ReadAuth) -> dict[str, Any]:
    """Latest report of each rank (timings, loss, grad norm; non-finite values as strings)
    with its straggler ``score`` and ``slow`` (the straggler detector's statistic and rule,
    as ``/metrics`` exports them), lowest score first; ``straggler``: the rule's settings."""
    with db.read() as conn:
        r = _run_or_404(conn, run)
        newest = reads.newest_step(conn, run_id=r["id"])
        return {"run": run, "ranks": detection.rank_rows(conn, r["id"], newest, straggler),
                "straggler": {"threshold": straggler.threshold,
                              "window_steps": straggler.window_steps,
                              "min_steps": straggler.min_steps,
                              "min_excess_s": straggler.min_excess_s}}


@router.get("/runs/{run}/rank-rollups", response_model=None,
            responses=documented(RankRollups))
def get_rank_rollups(
    run: RunName,
    db: DB,
    _auth: ReadAuth,
    attempt: Annotated[U31 | None, Query()] = None,
    rank: Annotated[U31 | None, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
) -> dict[str, Any]:
    """The per-rank summaries of the steps whose per-rank rows retention rolled up (of the
    run's current attempt unless ``attempt`` says; one rank with ``rank``), in (bucket, rank)
    order: count, sums, maxima and means of the phase times, the loss's minimum too.
    ``kept_from_step``: the oldest step whose per-rank rows are kept in full (null: none);
    ``rolled_up_steps``: [first, last] step rolled up (null: nothing rolled up)."""
    with db.read() as conn:
        r = _run_or_404(conn, run)
        a = int(r["attempt"]) if attempt is None else attempt
        return {"run": run, "attempt": a,
                "kept_from_step": retention_store.kept_from_step(conn, run_id=r["id"], attempt=a),
                "rolled_up_steps": retention_store.rolled_up_steps(conn, run_id=r["id"],
                                                                   attempt=a),
                "rollups": retention_store.rollups(conn, run_id=r["id"], attempt=a, rank=rank,
                                                   limit=limit)}


def _listing(db: Any, run: str, key: str, fn: Any, limit: int) -> dict[str, Any]:
    with db.read() as conn:
        r = _run_or_404(conn, run)
        return {"run": run, key: fn(conn, run_id=r["id"], limit=limit)}


Limit = Annotated[int, Query(ge=1, le=10_000)]


@router.get("/runs/{run}/checkpoints", response_model=None,
            responses=documented(CheckpointList))
def get_checkpoints(run: RunName, db: DB, _auth: ReadAuth, limit: Limit = 1000) -> dict[str, Any]:
    return _listing(db, run, "checkpoints", reads.list_checkpoints, limit)


@router.get("/runs/{run}/incidents", response_model=None,
            responses=documented(IncidentList))
def get_incidents(run: RunName, db: DB, _auth: ReadAuth, limit: Limit = 1000) -> dict[str, Any]:
    """Newest first; a crash names its root cause and whose fault it is at the top level."""
    out = _listing(db, run, "incidents", reads.list_incidents, limit)
    out["incidents"] = [_with_root_cause(i) for i in out["incidents"]]
    return out


def _with_root_cause(incident: dict[str, Any]) -> dict[str, Any]:
    cls, rc = rootcause.of_incident(incident.get("details"))
    return {**incident, "failure_class": cls,
            "root_cause": None if rc is None else rc.as_dict()}


@router.get("/runs/{run}/actions", response_model=None, responses=documented(ActionList))
def get_actions(run: RunName, db: DB, _auth: ReadAuth, limit: Limit = 1000) -> dict[str, Any]:
    """Newest first; each restart with its ``anatomy`` (as on ``/actions/{id}``)."""
    with db.read() as conn:
        r = _run_or_404(conn, run)
        return {"run": run, "actions": efficiency.with_anatomy(
            conn, reads.list_actions(conn, run_id=r["id"], limit=limit))}


@router.get("/runs/{run}/events", response_model=None, responses=documented(EventList))
def get_events(run: RunName, db: DB, _auth: ReadAuth, limit: Limit = 1000) -> dict[str, Any]:
    return _listing(db, run, "events", reads.list_events, limit)


class RestartRequest(BaseModel):
    """Where to restart from: at most one of ``checkpoint`` (an id, as listed by
    ``/checkpoints``) or ``step``, never a path; neither: the newest complete checkpoint."""

    checkpoint: U31 | None = Field(
        default=None, description="checkpoint id; default: the newest complete one"
    )
    step: U31 | None = Field(default=None, description="or the checkpoint's step")
    reason: Text = text(max_length=1000)

    model_config = {"extra": "forbid"}

    _no_path = model_validator(mode="before")(no_path)
    _checkpoint_id = field_validator("checkpoint", mode="before")(checkpoint_id)

    @model_validator(mode="after")
    def _one_target(self) -> RestartRequest:
        if self.checkpoint is not None and self.step is not None:
            raise ValueError('give at most one of "checkpoint" (an id) or "step"')
        return self


class StopRequest(BaseModel):
    reason: Text = text(max_length=1000)


def _operator(db: Any, run: str, now: float, decide: Any, live_s: float | None = None
              ) -> dict[str, Any]:
    with db.write() as conn:
        r = _run_or_404(conn, run)
        decision = decide(conn, r)
        if isinstance(decision, policy.Note):
            raise HTTPException(status.HTTP_409_CONFLICT, f"nothing done: {decision.why}")
        action_id = actions.apply(conn, run=r, decision=decision, now=now, live_s=live_s)
        return {"run": run, "action_id": action_id, "decision": type(decision).__name__.lower()}


@router.post("/runs/{run}/restart", response_model=None,
             responses=documented(OperatorDecision))
def restart_run(
    run: RunName, req: RestartRequest, db: DB, clock: ClockDep, auth: OperatorAuth,
    settings: Settings,
) -> dict[str, Any]:
    """Gang-restart the run as its next attempt (operator; no backoff, outside the budget),
    from the checkpoint named by id or step (it must exist, be complete and be on the current
    lineage; the checkpoints of the branch beyond it are abandoned, as by a rollback), or
    from the newest complete one."""
    auth.require_run(run)

    def decide(conn: Connection, r: RunRow) -> policy.Decision:
        step: int | None = None
        ckpt: str | None
        if req.checkpoint is not None or req.step is not None:
            ck = known_checkpoint(conn, run_id=r["id"], run=run, checkpoint_id=req.checkpoint,
                                  step=req.step)
            ckpt, step = ck["path"], int(ck["step"])
        else:
            newest = rec.newest_complete_checkpoint(conn, run_id=r["id"])
            ckpt = newest["path"] if newest else None
        return policy.operator_restart(actions.facts(r), checkpoint=ckpt, step=step,
                                       reason=req.reason, actor=auth.actor, now=clock())

    return _operator(db, run, clock(), decide, live_s=settings.node_lost.deadline_s)


@router.post("/runs/{run}/stop", response_model=None,
             responses=documented(OperatorDecision))
def stop_run(
    run: RunName, req: StopRequest, db: DB, clock: ClockDep, auth: OperatorAuth
) -> dict[str, Any]:
    """Stop every agent of the run; the run ends as "stopped" (operator)."""
    auth.require_run(run)
    return _operator(
        db, run, clock(),
        lambda conn, r: policy.operator_stop(actions.facts(r), reason=req.reason,
                                             actor=auth.actor),
    )

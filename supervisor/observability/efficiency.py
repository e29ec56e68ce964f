"""Where a run loses time, read from the store into the pure modules of
``trainwarden.supervisor.goodput``:
the anatomy of every restart (``anatomy``), the checkpoint-interval advice (``interval``) and
the MFU and scaling diagnosis (``mfu``).

The API, the dashboard and ``/metrics`` all call these functions, so each shows the same
number, computed once in the pure module.  Everything here runs at read time (a request, a
scrape), never in the evaluator's tick; each read is bounded (a grouped read per run, a
primary-key lookup per restart action, one window of rank steps).
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from trainwarden.supervisor.control import policy
from trainwarden.supervisor.enums import (
    ACTIVE_STATUSES,
    INTERRUPTING,
    ROLLED_BACK,
    ActionKind,
    IncidentKind,
)
from trainwarden.supervisor.goodput import interval as iv
from trainwarden.supervisor.goodput.anatomy import Anatomy, anatomy
from trainwarden.supervisor.goodput.ettr import save_stall_s
from trainwarden.supervisor.goodput.mfu import (
    RankPhases,
    ScalingConfig,
    diagnose_mfu,
    diagnose_scaling,
    mfu,
    mfu_factor,
)
from trainwarden.supervisor.store import efficiency as eff
from trainwarden.supervisor.store import reads
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import RunRow

MFU_WINDOW_STEPS = 50  # newest steps every rank delivered that the per-rank shares average


# ---------------------------------------------------------------------------------------------
# restart counts


def restart_counts(conn: Connection, run_id: int) -> policy.RestartCounts:
    """The run's restarts (``policy.restart_counts`` over its restart actions): the one count
    the runs list, the run page, the CLI and ``/metrics`` show."""
    return policy.restart_counts(rec.restart_history(conn, run_id=run_id))


# ---------------------------------------------------------------------------------------------
# restart anatomy


def restart_anatomies(conn: Connection, run_id: int,
                      action_ids: Collection[int] | None = None) -> dict[int, Anatomy]:
    """Restart action id -> its anatomy (phases from the milestones the store holds)."""
    return {aid: anatomy(times) for aid, times in
            eff.restart_milestones(conn, run_id=run_id, action_ids=action_ids).items()}


def with_anatomy(conn: Connection, rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Action rows with ``anatomy`` added (``Anatomy.as_dict``; None for a stop)."""
    acts = [dict(a) for a in rows]
    by_run: dict[int, list[int]] = {}
    for a in acts:
        if a["kind"] == ActionKind.RESTART:
            by_run.setdefault(int(a["run_id"]), []).append(int(a["id"]))
    found: dict[int, Anatomy] = {}
    for run_id, ids in by_run.items():
        found.update(restart_anatomies(conn, run_id, ids))
    for a in acts:
        an = found.get(int(a["id"]))
        a["anatomy"] = an.as_dict() if an is not None else None
    return acts


# ---------------------------------------------------------------------------------------------
# checkpoint-interval advice


def _finite(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


def _mean(xs: list[float]) -> float | None:
    """The mean of the finite values (None when there are none, or it overflows)."""
    ok = [x for x in xs if math.isfinite(x)]
    return _finite(statistics.fmean(ok)) if ok else None


def interval_advice(conn: Connection, run: RunRow, now: float,
                    prior_per_node_day: float | None = None) -> dict[str, Any]:
    """``interval.advise`` on the run's own figures, with what it was computed from.

    * failures: the run's interrupting incidents (``trainwarden.supervisor.enums.INTERRUPTING``)
    and its rolled-back spikes and NaNs, over its
      wall time (creation to now, or to its end) on its nodes (the agents it registered);
    * save cost: the mean stall of its complete checkpoints (``ettr.save_stall_s``: what the
      worker measured the save call to block, an asynchronous save's staging included), the
      newest ``store.efficiency.CHECKPOINTS_READ``;
    * current interval: the mean time between two consecutive complete checkpoints of the
      same attempt;
    * restart cost: the mean fault-to-first-step time of its restarts (the fault: the exit
      report behind the incident, else the incident's opening, else the decision), over
      those that reached their first step (``measured.restarts_timed`` of
      ``measured.restarts``, the run's restarts as ``restart_counts`` counts them).

    ``state`` is "ok" when a recommendation was made, else "not_enough_data" with what is
    missing in ``missing``."""
    run_id = int(run["id"])
    end = now if run["status"] in ACTIVE_STATUSES else float(run["updated_at"])
    observed = max(0.0, _finite(end - float(run["created_at"])) or 0.0)
    nodes = max(1, eff.node_count(conn, run_id=run_id))
    failures = eff.failure_count(conn, run_id=run_id)
    ckpts = eff.complete_checkpoints(conn, run_id=run_id)
    stalls = [s for c in ckpts if (s := save_stall_s(
        stall_s=c.get("stall_s"), save_s=c["save_s"], async_save=bool(c["async_save"])))
        is not None]
    gaps = [b["t"] - a["t"] for a, b in itertools.pairwise(ckpts)
            if a["attempt"] == b["attempt"] and b["t"] > a["t"]]
    faults = eff.restart_faults(conn, run_id=run_id)
    costs = []
    for aid, an in restart_anatomies(conn, run_id).items():
        first, decided = an.times["first_step"], an.times["decided"]
        start = faults.get(aid, decided)
        if first is not None and start is not None:
            costs.append(max(0.0, first - start))
    save_stall, interval, restart = _mean(stalls), _mean(gaps), _mean(costs)
    advice = iv.advise(iv.IntervalInputs(
        nodes=nodes, failures=failures, observed_s=observed,
        save_stall_s=save_stall or 0.0, restart_s=restart or 0.0,
        interval_s=interval if interval and interval > 0 else None,
        prior_per_node_day=prior_per_node_day))
    missing = []
    if advice.rate_source == "none":
        missing.append("failures: none observed yet, so no failure rate")
    if save_stall is None:
        missing.append("save cost: no complete checkpoint with a save time")
    if interval is None:
        missing.append("current interval: fewer than two checkpoints in one attempt")
    if restart is None:
        missing.append("restart cost: no restart reached its first step (0 assumed)")
    out = advice.as_dict()
    out["state"] = "ok" if advice.recommended_s is not None else "not_enough_data"
    out["missing"] = missing
    out["measured"] = {"checkpoints": len(ckpts), "saves_timed": len(stalls),
                       "intervals": len(gaps), "restarts_timed": len(costs),
                       "restarts": restart_counts(conn, run_id).total,
                       "failure_kinds": [*(str(k) for k in IncidentKind if k in INTERRUPTING),
                                         *(f"{k} (rolled back)" for k in IncidentKind
                                           if k in ROLLED_BACK)]}
    return out


# ---------------------------------------------------------------------------------------------
# MFU and scaling


def mfu_report(conn: Connection, run: RunRow, *, window_steps: int = MFU_WINDOW_STEPS,
               scaling_cfg: ScalingConfig | None = None) -> dict[str, Any] | None:
    """The run's MFU (the same figure as ``trainwarden_run_mfu_ratio``), its band and what
    the band usually means, each rank's shares of the step (data wait, compute,
    communication and the rest) and MFU over the newest ``window_steps`` steps every rank
    delivered, and the scaling diagnosis (efficiency when the run declared a one-device
    baseline throughput).  None before the run's first step."""
    run_id = int(run["id"])
    newest = reads.newest_step(conn, run_id=run_id)
    if newest is None:
        return None
    attempt = int(newest["attempt"])
    tp = reads.throughput(conn, run_id=run_id, attempt=attempt)
    declared = reads.flops_declaration(conn, run_id=run_id)
    run_mfu = mfu(declared, tp)
    delivered = reads.delivered_step(conn, run_id=run_id, attempt=attempt)
    phases: list[RankPhases] = []
    if delivered is not None:
        phases = [RankPhases(rank=r, data_s=d, compute_s=k, step_s=s)
                  for r, d, k, s in eff.rank_phase_means(
                      conn, run_id=run_id, attempt=attempt,
                      step_from=delivered - window_steps + 1, step_to=delivered)]
    factor = mfu_factor(declared, tp["ranks"])
    unit = factor[0] if factor is not None else None
    rate = (tp["samples_per_s"] if unit == "samples" else tp["tokens_per_s"]
            if unit == "tokens" else None)
    devices = tp["ranks"] or len(phases) or 1
    flops_rank_step = peak = None
    if declared is not None and unit is not None and rate is not None and tp["steps_per_s"]:
        per_unit = declared["flops_per_sample" if unit == "samples" else "flops_per_token"]
        flops_rank_step = rate / tp["steps_per_s"] * per_unit / devices
        peak = declared["peak_flops_per_rank"]
    diag = diagnose_mfu(run_mfu, phases, flops_per_rank_step=flops_rank_step,
                        peak_flops_per_rank=peak)
    baseline = declared.get("baseline_per_device") if declared is not None else None
    scaling = diagnose_scaling(phases, devices=devices, throughput=rate,
                               baseline_per_device=baseline if rate is not None else None,
                               config=scaling_cfg)
    return {**diag.as_dict(), "attempt": attempt,
            "window": {"steps": window_steps, "to_step": delivered},
            "unit": unit, "throughput": rate, "declared": declared,
            "scaling": {**scaling.as_dict(), "baseline_per_device": baseline}}

"""What the dashboard shows, assembled from the store (no HTML here)."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping
from typing import Any

from trainwarden.agent.core import rootcause
from trainwarden.agent.core.rootcause import FailureClass
from trainwarden.supervisor.control import actions, detection
from trainwarden.supervisor.control.node_states import NodeView
from trainwarden.supervisor.control.node_views import condition_of, node_views
from trainwarden.supervisor.detect.findings import FindingKind
from trainwarden.supervisor.detect.straggler import StragglerConfig
from trainwarden.supervisor.enums import ActionKind, IncidentKind, RestartCause
from trainwarden.supervisor.goodput.anatomy import PHASES
from trainwarden.supervisor.goodput.mfu import mfu, mfu_factor
from trainwarden.supervisor.goodput.spike_cost import summary_of
from trainwarden.supervisor.observability import efficiency, metrics
from trainwarden.supervisor.store import reads, registry, windows
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.health import workers_total
from trainwarden.supervisor.store.rows import AgentRow, RunRow, Throughput

LIST_LIMIT = 200  # rows of each table on the run page
RANKS_SHOWN = 32  # the lowest straggler scores
SPIKE_KINDS = frozenset({IncidentKind.LOSS_SPIKE, IncidentKind.NONFINITE, RestartCause.SPIKE})
RANK_SERIES_SHOWN = 8
RANK_POINTS_BUDGET = 20_000  # per-rank timing rows read for the phase-time chart


def run_row(conn: Connection, run: RunRow, now: float) -> dict[str, Any]:
    """One line of the runs list (also the head of the run page)."""
    newest = reads.newest_step(conn, run_id=run["id"])
    tp: Throughput = (
        reads.throughput(conn, run_id=run["id"], attempt=int(newest["attempt"])) if newest
        else {"samples_per_s": None, "tokens_per_s": None, "steps_per_s": None, "ranks": None})
    ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
    declared = reads.flops_declaration(conn, run_id=run["id"])
    restarts = efficiency.restart_counts(conn, int(run["id"]))
    return {
        **run,
        # the run's restarts as the API and /metrics count them (not the row's counter of
        # automatic ones), with the causes that are not 0
        "restarts": restarts.total,
        "restarts_by_cause": {c: n for c, n in restarts.by_cause.items() if n},
        "step": newest["step"] if newest else None,
        "step_at": newest["t_last"] if newest else None,
        "loss": metrics.mean_loss(newest) if newest else None,
        "throughput": tp,
        "flops_declared": declared,
        "mfu": mfu(declared, tp),
        "checkpoint": ckpt,
        "checkpoint_age": (now - ckpt["t"]) if ckpt else None,
        "open_incidents": reads.open_incident_counts(conn, run_id=run["id"]),
        "condition": (c.as_dict() if (c := condition_of(conn, run=run)) is not None else None),
    }


def runs_overview(conn: Connection, now: float,
                  readable: Callable[[str], bool] = lambda name: True) -> list[dict[str, Any]]:
    """The runs list, newest first: the runs ``readable`` admits (a scoped token's own)."""
    return [run_row(conn, r, now) for r in reversed(registry.list_runs(conn))
            if readable(str(r["name"]))]


def stacks_of(incident: Mapping[str, Any]) -> list[tuple[str, str]]:
    """``details.stacks`` ({rank: text}) as sorted (rank, text) pairs."""
    stacks = (incident.get("details") or {}).get("stacks")
    if not isinstance(stacks, dict):
        return []

    def key(k: str) -> tuple[int, str]:
        return (int(k), "") if str(k).isdigit() else (1 << 30, str(k))

    return [(str(k), str(stacks[k])) for k in sorted(stacks, key=key)]


def root_cause_of(incident: Mapping[str, Any]) -> dict[str, Any]:
    """A crash incident's root cause and whose fault it is, for the page (None: not kept)."""
    cls, rc = rootcause.of_incident(incident.get("details"))
    fault = {FailureClass.USER_CODE: "the training script", FailureClass.MACHINE: "the machine",
             FailureClass.STORAGE: "the checkpoint disk", FailureClass.UNKNOWN: "unknown"}
    return {"failure_class": cls, "fault": fault.get(cls) if cls else None,
            "root_cause": None if rc is None else rc.as_dict(),
            "stopped_by_rule": (incident.get("details") or {}).get("stop_rule")}


def run_tables(conn: Connection, run: RunRow, now: float,
               straggler: StragglerConfig, live_s: float) -> dict[str, Any]:
    """Incidents, actions, checkpoints, nodes and ranks of a run (``straggler``: the
    detector's configuration, which the ranks' scores are computed with; ``live_s``: the
    node-lost deadline, a node heard from within it is live)."""
    run_id = run["id"]
    incidents = [{**inc, "stacks": stacks_of(inc), **root_cause_of(inc),
                  "details_other": {k: v for k, v in (inc["details"] or {}).items()
                                    if k not in ("stacks", "root_cause")}}
                 for inc in reads.list_incidents(conn, run_id=run_id, limit=LIST_LIMIT)]
    newest = reads.newest_step(conn, run_id=run_id)
    ranks = detection.rank_rows(conn, run_id, newest, straggler)
    protected = set(run.get("protected") or [])
    checkpoints = [{**c, "protected": c["path"] in protected}
                   for c in reads.list_checkpoints(conn, run_id=run_id, limit=LIST_LIMIT)]
    cap = actions.capacity(conn, run_id=int(run_id), now=now, live_s=live_s)
    agents = registry.run_agents(conn, run_id=run_id)
    views = node_views(conn, run=run, agents=agents, now=now, live_s=live_s, capacity=cap)
    return {
        "incidents": incidents,
        # The newest failure with a root cause: first on the run's page.
        "failure": next((i for i in incidents if i["root_cause"] is not None), None),
        # each restart with its anatomy (the same seconds as the API's and the histogram's)
        "actions": efficiency.with_anatomy(
            conn, reads.list_actions(conn, run_id=run_id, limit=LIST_LIMIT)),
        "advice": efficiency.interval_advice(conn, run, now),
        "mfu_report": efficiency.mfu_report(conn, run),
        "phase_names": PHASES,
        "checkpoints": checkpoints,
        "agents": [node_health(a, views[int(a["id"])]) for a in agents],
        "membership": cap,
        "ranks": ranks[:RANKS_SHOWN],
        "ranks_total": len(ranks),
        "straggler": straggler,
    }


def node_health(agent: AgentRow, view: NodeView) -> dict[str, Any]:
    """An agent row plus what the nodes table shows of its state (``node_states``: the
    API's and the CLI's) and health."""
    free, total = agent["disk_free_bytes"], agent["disk_total_bytes"]
    raw_workers, raw_gpus = agent["workers"], agent["gpus"]
    workers: list[dict[str, Any]] = [w for w in raw_workers if isinstance(w, dict)] \
        if isinstance(raw_workers, list) else []
    gpus: dict[str, Any] | None = raw_gpus if isinstance(raw_gpus, dict) else None
    return {
        **agent,
        "state": view.state, "reported_state": agent["state"], "seen_s": view.seen_s,
        "readings_stale": view.stale,
        "disk_free_ratio": free / total if free is not None and total else None,
        "workers_cpu": workers_total(workers, "cpu_percent"),
        "workers_rss": workers_total(workers, "rss_bytes"),
        "workers_list": sorted(workers, key=lambda w: (w.get("rank", 0), w.get("pid", 0))),
        "gpu_available": None if gpus is None else bool(gpus.get("available")),
        "gpu_reason": "" if gpus is None else str(gpus.get("reason") or ""),
        "gpu_devices": [d for d in (gpus or {}).get("devices") or [] if isinstance(d, dict)],
    }


def mfu_feed(conn: Connection, run_id: int) -> dict[str, Any] | None:
    """What the page's script needs to draw MFU from the throughput it already has."""
    newest = reads.newest_step(conn, run_id=run_id)
    if newest is None:
        return None
    tp = reads.throughput(conn, run_id=run_id, attempt=int(newest["attempt"]))
    factor = mfu_factor(reads.flops_declaration(conn, run_id=run_id), tp["ranks"])
    return None if factor is None else {"unit": factor[0], "factor": factor[1]}


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _spike_cost(details: dict[str, Any]) -> str | None:
    """What the spike cost against a rollback, as its incident or event stated it."""
    d = details.get("spike_cost")
    return summary_of(d) if isinstance(d, dict) else None


def markers(conn: Connection, run_id: int) -> list[dict[str, Any]]:
    """Vertical markers of the loss chart: spike episodes and where restarts resumed."""
    out: list[dict[str, Any]] = []
    for inc in reads.list_incidents(conn, run_id=run_id, limit=LIST_LIMIT):
        if inc["kind"] not in SPIKE_KINDS:
            continue
        d = inc.get("details") or {}
        start = _int(d.get("start_step"))
        if start is None:
            start = _int(inc.get("step"))
        if start is None:
            start = _int(d.get("step"))
        if start is None:
            continue
        end = next((v for v in (_int(d.get(k)) for k in ("end_step", "last_high_step", "step"))
                    if v is not None), start)
        out.append({"type": "spike", "kind": inc["kind"], "from": start,
                    "to": max(start, end), "label": f"{inc['kind']} #{inc['id']}",
                    "cost": _spike_cost(d)})
    # Spikes that came back by themselves: events, not incidents (no rollback), shaded too.
    for ev in reads.list_events(conn, run_id=run_id, limit=LIST_LIMIT):
        if ev["name"] != FindingKind.LOSS_SPIKE_TRANSIENT:
            continue
        d = ev.get("details") or {}
        start = _int(d.get("start_step"))
        if start is None:
            start = _int(ev.get("step"))
        if start is None:
            continue
        end = _int(d.get("recovered_at_step")) or _int(d.get("last_high_step")) or start
        out.append({"type": "spike", "kind": FindingKind.LOSS_SPIKE_TRANSIENT, "from": start,
                    "to": max(start, end), "label": "transient spike (no rollback)",
                    "cost": _spike_cost(d)})
    for a in reads.list_actions(conn, run_id=run_id, limit=LIST_LIMIT):
        if a["kind"] == ActionKind.STOP:
            continue
        plan = a.get("plan") or {}
        step = _int(a.get("resumed_step"))
        if step is None:
            step = _int(plan.get("checkpoint_step")) or _int(plan.get("step"))
        if step is None:
            continue
        out.append({"type": a["kind"], "kind": a["kind"], "from": step, "to": step,
                    "label": f"{a['kind']} #{a['id']} (attempt {a['attempt']})"})
    return out


def rank_series(conn: Connection, run_id: int, straggler: StragglerConfig) -> dict[str, Any]:
    """Per-rank data+compute seconds over the newest attempt's last steps: the slowest ranks
    and the median over all ranks (so a slow rank stands out)."""
    newest = reads.newest_step(conn, run_id=run_id)
    if newest is None:
        return {"attempt": None, "steps": [], "series": [], "median": []}
    nodes = windows.rank_nodes(conn, run_id=run_id)
    n_ranks = max(1, len(nodes))
    window = max(straggler.window_steps,
                 min(detection.RANK_CHART_MAX_STEPS, RANK_POINTS_BUDGET // n_ranks))
    rows = windows.rank_phase_rows(conn, run_id=run_id, attempt=int(newest["attempt"]),
                                step_from=int(newest["step"]) - window + 1)
    by_step: dict[int, dict[int, float]] = {}
    for r in rows:
        if r["data_s"] is None and r["compute_s"] is None:
            continue
        by_step.setdefault(int(r["step"]), {})[int(r["rank"])] = \
            float(r["data_s"] or 0.0) + float(r["compute_s"] or 0.0)
    steps = sorted(by_step)
    # the same scores as the table's, the API's and /metrics'
    scores = detection.run_scores(conn, run_id, newest, straggler)
    shown = sorted(scores, key=lambda k: (scores[k].score, k))[:RANK_SERIES_SHOWN]
    return {
        "attempt": newest["attempt"],
        "steps": steps,
        "threshold": straggler.threshold,
        "series": [{"rank": k, "node": nodes.get(k, ""), "score": scores[k].score,
                    "slow": scores[k].slow,
                    "values": [by_step[s].get(k) for s in steps]} for k in shown],
        "median": [statistics.median(by_step[s].values()) for s in steps],
    }

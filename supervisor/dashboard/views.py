"""What the dashboard shows, assembled from the store (no HTML here)."""

from __future__ import annotations

import statistics
from typing import Any

from sqlalchemy import Connection

from supervisor import metrics
from supervisor.detect.findings import LOSS_SPIKE_TRANSIENT
from supervisor.store import repo

LIST_LIMIT = 200  # rows of each table on the run page
RANKS_SHOWN = 32  # the lowest straggler scores
SPIKE_KINDS = frozenset({"loss_spike", "nonfinite", "spike"})
RANK_SERIES_SHOWN = 8
RANK_POINTS_BUDGET = 20_000  # per-rank timing rows read for the phase-time chart


def run_row(conn: Connection, run: dict[str, Any], now: float) -> dict[str, Any]:
    """One line of the runs list (also the head of the run page)."""
    newest = repo.newest_step(conn, run_id=run["id"])
    tp = (repo.throughput(conn, run_id=run["id"], attempt=int(newest["attempt"]))
          if newest else {"samples_per_s": None, "tokens_per_s": None, "steps_per_s": None,
                          "ranks": None})
    ckpt = repo.newest_complete_checkpoint(conn, run_id=run["id"])
    declared = repo.flops_declaration(conn, run_id=run["id"])
    return {
        **run,
        "step": newest["step"] if newest else None,
        "step_at": newest["t_last"] if newest else None,
        "loss": metrics.mean_loss(newest) if newest else None,
        "throughput": tp,
        "flops_declared": declared,
        "mfu": metrics.mfu(declared, tp),
        "checkpoint": ckpt,
        "checkpoint_age": (now - ckpt["t"]) if ckpt else None,
        "open_incidents": repo.open_incident_counts(conn, run_id=run["id"]),
    }


def runs_overview(conn: Connection, now: float) -> list[dict[str, Any]]:
    return [run_row(conn, r, now) for r in reversed(repo.list_runs(conn))]


def stacks_of(incident: dict[str, Any]) -> list[tuple[str, str]]:
    """``details.stacks`` ({rank: text}) as sorted (rank, text) pairs."""
    stacks = (incident.get("details") or {}).get("stacks")
    if not isinstance(stacks, dict):
        return []

    def key(k: str) -> tuple[int, str]:
        return (int(k), "") if str(k).isdigit() else (1 << 30, str(k))

    return [(str(k), str(stacks[k])) for k in sorted(stacks, key=key)]


def run_tables(conn: Connection, run: dict[str, Any], now: float) -> dict[str, Any]:
    """Incidents, actions, checkpoints, nodes and ranks of a run."""
    run_id = run["id"]
    incidents = repo.list_incidents(conn, run_id=run_id, limit=LIST_LIMIT)
    for inc in incidents:
        inc["stacks"] = stacks_of(inc)
        inc["details_other"] = {k: v for k, v in (inc.get("details") or {}).items()
                                if k != "stacks"}
    newest = repo.newest_step(conn, run_id=run_id)
    scores = metrics.run_scores(conn, run_id, newest)
    ranks = repo.rank_latest(conn, run_id=run_id)
    for r in ranks:
        r["score"] = scores.get(int(r["rank"]))
    ranks.sort(key=lambda r: (r["score"] if r["score"] is not None else 9e9, r["rank"]))
    protected = set(run.get("protected") or [])
    checkpoints = repo.list_checkpoints(conn, run_id=run_id, limit=LIST_LIMIT)
    for c in checkpoints:
        c["protected"] = c["path"] in protected
    return {
        "incidents": incidents,
        "actions": repo.list_actions(conn, run_id=run_id, limit=LIST_LIMIT),
        "checkpoints": checkpoints,
        "agents": [node_health(a) for a in repo.run_agents(conn, run_id=run_id)],
        "ranks": ranks[:RANKS_SHOWN],
        "ranks_total": len(ranks),
    }


def node_health(agent: dict[str, Any]) -> dict[str, Any]:
    """An agent row plus what the nodes table shows of its health."""
    free, total = agent.get("disk_free_bytes"), agent.get("disk_total_bytes")
    raw_workers, raw_gpus = agent.get("workers"), agent.get("gpus")
    workers: list[dict[str, Any]] = [w for w in raw_workers if isinstance(w, dict)] \
        if isinstance(raw_workers, list) else []
    gpus: dict[str, Any] | None = raw_gpus if isinstance(raw_gpus, dict) else None
    return {
        **agent,
        "disk_free_ratio": free / total if free is not None and total else None,
        "workers_cpu": sum(float(w.get("cpu_percent") or 0.0) for w in workers)
        if workers else None,
        "workers_rss": sum(float(w.get("rss_bytes") or 0) for w in workers) if workers else None,
        "workers_list": sorted(workers, key=lambda w: (w.get("rank", 0), w.get("pid", 0))),
        "gpu_available": None if gpus is None else bool(gpus.get("available")),
        "gpu_reason": "" if gpus is None else str(gpus.get("reason") or ""),
        "gpu_devices": [d for d in (gpus or {}).get("devices") or [] if isinstance(d, dict)],
    }


def mfu_feed(conn: Connection, run_id: int) -> dict[str, Any] | None:
    """What the page's script needs to draw MFU from the throughput it already has."""
    newest = repo.newest_step(conn, run_id=run_id)
    if newest is None:
        return None
    tp = repo.throughput(conn, run_id=run_id, attempt=int(newest["attempt"]))
    factor = metrics.mfu_factor(repo.flops_declaration(conn, run_id=run_id), tp["ranks"])
    return None if factor is None else {"unit": factor[0], "factor": factor[1]}


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def markers(conn: Connection, run_id: int) -> list[dict[str, Any]]:
    """Vertical markers of the loss chart: spike episodes and where restarts resumed."""
    out: list[dict[str, Any]] = []
    for inc in repo.list_incidents(conn, run_id=run_id, limit=LIST_LIMIT):
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
                    "to": max(start, end), "label": f"{inc['kind']} #{inc['id']}"})
    # Spikes that came back by themselves: events, not incidents (no rollback), shaded too.
    for ev in repo.list_events(conn, run_id=run_id, limit=LIST_LIMIT):
        if ev["name"] != LOSS_SPIKE_TRANSIENT:
            continue
        d = ev.get("details") or {}
        start = _int(d.get("start_step"))
        if start is None:
            start = _int(ev.get("step"))
        if start is None:
            continue
        end = _int(d.get("recovered_at_step")) or _int(d.get("last_high_step")) or start
        out.append({"type": "spike", "kind": LOSS_SPIKE_TRANSIENT, "from": start,
                    "to": max(start, end), "label": "transient spike (no rollback)"})
    for a in repo.list_actions(conn, run_id=run_id, limit=LIST_LIMIT):
        if a["kind"] == "stop":
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


def rank_series(conn: Connection, run_id: int) -> dict[str, Any]:
    """Per-rank data+compute seconds over the newest attempt's last steps: the slowest ranks
    and the median over all ranks (so a slow rank stands out)."""
    newest = repo.newest_step(conn, run_id=run_id)
    if newest is None:
        return {"attempt": None, "steps": [], "series": [], "median": []}
    nodes = repo.rank_node_names(conn, run_id=run_id)
    n_ranks = max(1, len(nodes))
    window = max(metrics.STRAGGLER_WINDOW, min(300, RANK_POINTS_BUDGET // n_ranks))
    rows = repo.rank_phase_rows(conn, run_id=run_id, attempt=int(newest["attempt"]),
                                step_from=int(newest["step"]) - window + 1)
    by_step: dict[int, dict[int, float]] = {}
    for r in rows:
        if r["data_s"] is None and r["compute_s"] is None:
            continue
        by_step.setdefault(int(r["step"]), {})[int(r["rank"])] = \
            float(r["data_s"] or 0.0) + float(r["compute_s"] or 0.0)
    steps = sorted(by_step)
    scores = metrics.run_scores(conn, run_id, newest)  # the same as the table's and /metrics'
    shown = sorted(scores, key=lambda k: (scores[k], k))[:RANK_SERIES_SHOWN]
    return {
        "attempt": newest["attempt"],
        "steps": steps,
        "series": [{"rank": k, "node": nodes.get(k, ""), "score": scores[k],
                    "values": [by_step[s].get(k) for s in steps]} for k in shown],
        "median": [statistics.median(by_step[s].values()) for s in steps],
    }

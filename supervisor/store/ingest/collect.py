"""A group of batches turned into rows (``collect``), merged where a key repeats, and
written (``flush``): the step rows in multi-row statements, the rare items as Core
statements."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    Connection,
)

from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.store._sql import finite, json_safe, split_float
from trainwarden.supervisor.store.health import gpu_health, worker_stats
from trainwarden.supervisor.store.ingest.clock import ClockCheck, IngestConfig, count_clock_skew
from trainwarden.supervisor.store.ingest.commands import apply_command_result
from trainwarden.supervisor.store.ingest.statements import (
    ATTEMPT_COLUMN,
    STEP_COLUMN,
    STEP_KEYS,
    HotSQL,
)
from trainwarden.supervisor.store.tables import (
    checkpoints,
    events,
    exits,
)


@dataclass
class Collected:
    """Rows of a group of batches, merged where a key repeats."""

    # rank_steps rows as tuples in STEP_KEYS order (what the multi-row statement binds)
    step_rows: list[tuple[Any, ...]] = field(default_factory=list)
    # (run id, rank) -> the newest step row of the rank and its agent (the ranks upsert's
    # row is built from it once, at the flush: a batch holds several steps of each rank)
    latest_rank: dict[tuple[int, int], tuple[tuple[Any, ...], int, wire.StepItem]] = field(
        default_factory=dict)
    aggs: dict[tuple[int, int, int], dict[str, Any]] = field(default_factory=dict)
    seen: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    exits: list[dict[str, Any]] = field(default_factory=list)
    results: list[tuple[int, int, wire.CommandResultItem, float]] = field(default_factory=list)
    # (run id, agent id, attempt, the batch's check) of batches with timestamps replaced
    skews: list[tuple[int, int, int, ClockCheck]] = field(default_factory=list)


def collect(acc: Collected, batch: wire.IngestBatch, *, run_id: int, now: float,
             cfg: IngestConfig, paths: list[str], member: bool = True) -> None:
    """``paths``: the batch's checkpoint paths as checked (``_checkpoint_paths``).
    ``member``: False for a spare (one that was replaced, say, and woke up): its steps,
    checkpoints and exits are not the run's and are not stored (the catalogue never lists
    what it writes); its heartbeat, events and command results are, its events marked as a
    non-member's (kept for the record, never acted on)."""
    if not member:
        dropped = (wire.StepItem, wire.CheckpointItem, wire.ExitItem)
        batch = batch.model_copy(update={
            "items": [it for it in batch.items if not isinstance(it, dropped)]})
        paths = []
    agent_id = batch.agent_id
    checked = iter(paths)
    clk = ClockCheck(now, cfg)
    t0 = clk.t(batch.sent_at, now, "sent_at")
    heartbeat: wire.HeartbeatItem | None = None
    # The step rows are nearly all of a batch: their loop is written out for speed (the
    # common values, finite and within the clock's bounds, take the short branch).
    lo, hi, isfinite = clk.lo, clk.hi, math.isfinite
    step_rows, latest = acc.step_rows, acc.latest_rank
    for it in batch.items:
        if isinstance(it, wire.StepItem):
            attempt = it.attempt if it.attempt is not None else batch.attempt
            t = it.t
            if t is None:
                t = t0
            elif not lo <= t <= hi:  # (also NaN)
                t = clk.t(t, t0, "step")
            loss, loss_sp = it.loss, None
            if loss is not None and not isfinite(loss):
                loss, loss_sp = split_float(loss)
            gn, gn_sp = it.grad_norm, None
            if gn is not None and not isfinite(gn):
                gn, gn_sp = split_float(gn)
            step_s = finite(it.step_s)
            row = (run_id, attempt, it.step, it.rank, t, it.batch_index, finite(it.data_s),
                   finite(it.compute_s), step_s, loss, loss_sp, gn, gn_sp, finite(it.lr))
            step_rows.append(row)
            key = (run_id, it.rank)
            prev = latest.get(key)
            if (prev is None
                    or (attempt, it.step) >= (prev[0][ATTEMPT_COLUMN], prev[0][STEP_COLUMN])):
                latest[key] = (row, agent_id, it)
            _merge_agg(acc.aggs, run_id, attempt, it, t=t, loss=loss, loss_special=loss_sp,
                       grad_norm_special=gn_sp, step_s=step_s)
        elif isinstance(it, wire.EventItem):
            acc.events.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "rank": it.rank, "t": clk.t(it.t, t0, "event"), "name": it.name,
                "step": it.step, "message": it.message, "details": json_safe(it.details),
                "member": member,
            })
        elif isinstance(it, wire.CheckpointItem):
            acc.checkpoints.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "step": it.step, "path": next(checked), "bytes": it.bytes,
                "lineage": it.lineage,
                "complete": it.complete, "save_s": finite(it.save_s),
                "async_save": it.async_save, "stall_s": finite(it.stall_s),
                "t": clk.t(it.t, t0, "checkpoint"),
            })
        elif isinstance(it, wire.HeartbeatItem):
            clk.t(it.t, t0, "heartbeat")  # (not stored: checked to be counted)
            heartbeat = it
        elif isinstance(it, wire.ExitItem):
            acc.exits.append({
                "run_id": run_id, "agent_id": agent_id,
                "attempt": it.attempt if it.attempt is not None else batch.attempt,
                "t": clk.t(it.t, t0, "exit"), "exit_code": it.exit_code,
                "signal": it.signal, "outcome": it.outcome,
                "failed_ranks": json_safe([f.model_dump(exclude_unset=True)
                                           for f in it.failed_ranks]),
                "handled": False, "verdict": None,
            })
        else:
            acc.results.append((agent_id, run_id, it, clk.t(it.t, t0, "command_result")))
    if clk.replaced:
        acc.skews.append((run_id, agent_id, batch.attempt, clk))
    acc.seen.append({
        "agent_id": agent_id, "now": now, "dropped": batch.dropped, "attempt": batch.attempt,
        "state": heartbeat.state if heartbeat else None,
        "disk": heartbeat.disk_free_bytes if heartbeat else None,
        "disk_total": heartbeat.disk_total_bytes if heartbeat else None,
        # JSON text for the raw statement (a cast to JSON on Postgres); None keeps the last.
        "workers": _worker_stats(heartbeat.workers) if heartbeat else None,
        "gpus": (json.dumps(gpu_health(heartbeat.gpus), separators=(",", ":"))
                 if heartbeat and heartbeat.gpus is not None else None),
    })


def _rank_row(step_row: tuple[Any, ...], agent_id: int, it: wire.StepItem) -> dict[str, Any]:
    """The ranks upsert's row of a rank's newest step row."""
    row = dict(zip(STEP_KEYS, step_row, strict=True))
    return {
        "run_id": row["run_id"], "rank": row["rank"], "agent_id": agent_id,
        "local_rank": it.local_rank, "pid": it.pid, "attempt": row["attempt"],
        "step": row["step"], "t": row["t"], "data_s": row["data_s"],
        "compute_s": row["compute_s"], "step_s": row["step_s"], "loss": row["loss"],
        "loss_special": row["loss_special"], "grad_norm": row["grad_norm"],
        "grad_norm_special": row["grad_norm_special"],
    }


def _worker_stats(workers: list[dict[str, Any]]) -> str:
    """The heartbeat's worker list as stored: the known keys with finite numbers only."""
    return json.dumps(worker_stats(workers), separators=(",", ":"))


def flush(conn: Connection, hot: HotSQL, cur: Any, acc: Collected, *, now: float
           ) -> list[dict[str, Any]]:
    """Write the collected rows; returns the step-aggregate rows for the caller to upsert."""
    if acc.seen:
        hot.executemany(cur, "agent_seen", acc.seen)
    if acc.step_rows:
        hot.insert_tuples(cur, "rank_steps", acc.step_rows)
    # Rare items: plain Core statements.
    if acc.events:
        conn.execute(events.insert(), acc.events)
    if acc.checkpoints:
        conn.execute(checkpoints.insert(), acc.checkpoints)
    if acc.exits:
        conn.execute(exits.insert(), acc.exits)
    for agent_id, run_id, res, t in acc.results:
        apply_command_result(conn, agent_id=agent_id, run_id=run_id, item=res, now=now, t=t)
    for run_id, agent_id, attempt, clk in acc.skews:
        count_clock_skew(conn, run_id=run_id, agent_id=agent_id, attempt=attempt, clk=clk,
                          now=now)
    if acc.latest_rank:
        hot.insert_rows(cur, "ranks", [_rank_row(*acc.latest_rank[k])
                                       for k in sorted(acc.latest_rank)])
    return [acc.aggs[k] for k in sorted(acc.aggs)]


def _merge_agg(
    aggs: dict[tuple[int, int, int], dict[str, Any]],
    run_id: int,
    attempt: int,
    it: wire.StepItem,
    *,
    t: float,
    loss: float | None,
    loss_special: str | None,
    grad_norm_special: str | None,
    step_s: float | None,
) -> None:
    """Add one rank-step row (its values as stored) to its step's aggregate."""
    key = (run_id, attempt, it.step)
    a = aggs.get(key)
    if a is None:
        a = aggs[key] = {
            "run_id": run_id, "attempt": attempt, "step": it.step, "ranks": 0,
            "loss_sum": None, "loss_count": 0, "loss_min": None, "loss_max": None,
            "loss_nonfinite": 0, "grad_norm_nonfinite": 0, "samples": 0, "tokens": 0,
            "step_s_max": None, "t_first": t, "t_last": t,
        }
    a["ranks"] += 1
    # (comparisons, not min/max: this runs for every rank-step row)
    if loss is not None:
        if a["loss_count"]:
            a["loss_sum"] += loss
            if loss < a["loss_min"]:
                a["loss_min"] = loss
            if loss > a["loss_max"]:
                a["loss_max"] = loss
        else:
            a["loss_sum"] = a["loss_min"] = a["loss_max"] = loss
        a["loss_count"] += 1
    if loss_special is not None:
        a["loss_nonfinite"] += 1
    if grad_norm_special is not None:
        a["grad_norm_nonfinite"] += 1
    if it.samples:
        a["samples"] += it.samples
    if it.tokens:
        a["tokens"] += it.tokens
    if step_s is not None and (a["step_s_max"] is None or step_s > a["step_s_max"]):
        a["step_s_max"] = step_s
    if t < a["t_first"]:
        a["t_first"] = t
    elif t > a["t_last"]:
        a["t_last"] = t

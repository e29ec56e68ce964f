"""Rollbacks: past a loss spike or NaN (skip the batches, lower the LR a while), past silent
data corruption (to the last checkpoint the replicas agreed on); a spike's cost against a
rollback's."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from trainwarden.agent.core.findings import FindingKind
from trainwarden.agent.protocol import LRSchedule
from trainwarden.supervisor.control.policy.core import (
    FindingFacts,
    PolicyConfig,
    RecoveryFacts,
    RunFacts,
    _int_or_none,
    budget_left,
)
from trainwarden.supervisor.control.policy.decisions import IncidentSpec, Restart, Stop
from trainwarden.supervisor.enums import IncidentKind, RestartCause, RunStatus
from trainwarden.supervisor.goodput.spike_cost import ProgressLost, SpikeCost, weigh


def spike_cost_of(f: FindingFacts, rec: RecoveryFacts | None, cfg: PolicyConfig
                  ) -> SpikeCost | None:
    """A loss spike's cost (``details["progress_lost"]``, the observer's figure) against a
    rollback's: to the checkpoint ``rollback_for_spike`` would load, skipping what it would
    skip, with the run's measured restart time (``details["restart_s"]``).  None for other
    findings, or when the observer had no figure."""
    p = f.details.get("progress_lost")
    if (f.kind not in (IncidentKind.LOSS_SPIKE, FindingKind.LOSS_SPIKE_TRANSIENT)
            or rec is None or not isinstance(p, dict) or f.step is None):
        return None
    try:
        progress = ProgressLost(**p)
    except TypeError:
        return None
    restart_s = f.details.get("restart_s")
    restart_s = float(restart_s) if isinstance(restart_s, int | float) else None
    good = [s for s, _ in rec.checkpoints if s <= f.step - cfg.rollback_margin_steps]
    if not good:
        return weigh(progress, checkpoint_step=None, restart_s=restart_s)
    detected = _int_or_none(f.details.get("detected_at_step")) or progress.now_step
    done = rec.restarts_by_cause.get(RestartCause.SPIKE, 0)
    ((first, last),), _ = rollback_plan(f.step, max(f.step, detected), good[-1], rec, cfg,
                                        done)
    return weigh(progress, checkpoint_step=good[-1], skipped_batches=last - first + 1,
                 restart_s=restart_s)


def rollback_for_spike(run: RunFacts, f: FindingFacts, incident: IncidentSpec,
                       rec: RecoveryFacts, cfg: PolicyConfig, now: float) -> Restart | Stop:
    """Roll back to the last good checkpoint, skip the batches the spike was seen on, lower the
    LR for a while in proportion.  Each recurrence widens the skip and lowers the LR further;
    past the budget the run is stopped (never a loop)."""
    what = "NaN/Inf" if f.kind == IncidentKind.NONFINITE else "loss spike"
    start = f.step if f.step is not None else (rec.high_step or 0)
    # A loss that climbed to NaN went wrong where the climb started.
    climb = _int_or_none(f.details.get("start_step"))
    if climb is not None:
        start = min(start, climb)
    detected = _int_or_none(f.details.get("detected_at_step"))
    if detected is None or detected < start:
        detected = f.step if f.step is not None and f.step >= start else start
    done = rec.restarts_by_cause.get(RestartCause.SPIKE, 0)
    may, why = budget_left(RestartCause.SPIKE, run, rec, cfg)
    if not may:
        return Stop(status=RunStatus.FAILED, incident=incident,
                    reason=f"{what} at step {start} after {done} rollback(s): {why}; the run is "
                           "stopped for a human to look at")
    good = [(s, p) for s, p in rec.checkpoints if s <= start - cfg.rollback_margin_steps]
    if not good:
        return Stop(status=RunStatus.FAILED, incident=incident,
                    reason=f"{what} at step {start}: no complete checkpoint at or before step "
                           f"{start - cfg.rollback_margin_steps} to roll back to")
    ck_step, ck_path = good[-1]
    skip, lr = rollback_plan(start, detected, ck_step, rec, cfg, done)
    again = f" (rollback {done + 1}: the spike came back)" if done else ""
    seen = f", detected at step {detected}" if detected != start else ""
    reason = (f"{what} at step {start}{seen}: roll back to step {ck_step}, skip batches "
              f"{skip[0][0]}-{skip[0][1]}, LR x{lr.scale:g} for {lr.steps} steps then back "
              f"over {lr.ramp_steps}{again}")
    return Restart(attempt=run.attempt + 1, checkpoint=ck_path, not_before=now, reason=reason,
                   incident=incident, skip=skip, lr=lr, cause=RestartCause.SPIKE,
                   rollback_to_step=ck_step)


def sdc_message(details: Mapping[str, Any], node: str | None) -> str:
    """What an incident of silent data corruption says: the step of the first disagreement,
    the rank(s) and node named (or the suspects, with two replicas)."""
    step = details.get("first_disagreement", details.get("step"))
    corrupt = [r for r in details.get("corrupt") or [] if isinstance(r, int)]
    n = details.get("replicas")
    if corrupt:
        who = (f"rank {', '.join(map(str, corrupt))}" + (f" on node {node}" if node else "")
               + f" disagrees with the other {int(n) - len(corrupt) if isinstance(n, int) else ''}"
               " replicas")
    else:
        suspects = details.get("suspects") or []
        who = (f"ranks {', '.join(map(str, suspects))} disagree and no majority names the "
               "corrupt one")
    return (f"silent data corruption: the replicas' parameter fingerprints disagree at step "
            f"{step}: {who}")


def rollback_for_sdc(run: RunFacts, f: FindingFacts, incident: IncidentSpec,
                     rec: RecoveryFacts, cfg: PolicyConfig, now: float) -> Restart | Stop:
    """Silent data corruption: roll back to the newest checkpoint at or before the last step
    the replicas agreed at (the state saved after that may carry the corruption), without
    skipping data or lowering the LR (the data is not at fault), and retrain.  The node of
    the corrupt rank is judged by the host ledger (``detect.node_health``: the same node
    again within the window is cordoned and replaced at this restart)."""
    first = _int_or_none(f.details.get("first_disagreement")) or f.step or 0
    agreed = _int_or_none(f.details.get("last_agreed_step"))
    limit = agreed if agreed is not None else first - 1
    may, why = budget_left(RestartCause.SDC, run, rec, cfg)
    if not may:
        return Stop(status=RunStatus.FAILED, incident=incident,
                    reason=f"{incident.cause}; {why}: the run is stopped for a human to look at")
    good = [(s, p) for s, p in rec.checkpoints if s <= limit]
    if not good:
        return Stop(status=RunStatus.FAILED, incident=incident,
                    reason=f"{incident.cause}; no complete checkpoint at or before step {limit}"
                           " (the last the replicas agreed at) to roll back to")
    ck_step, ck_path = good[-1]
    reason = (f"{incident.cause}; roll back to step {ck_step}, the newest checkpoint the "
              f"replicas agreed on ({ck_path})")
    chosen = replace(incident, cause=reason, details={**incident.details, "checkpoint": ck_path,
                                                      "checkpoint_step": ck_step})
    return Restart(attempt=run.attempt + 1, checkpoint=ck_path, not_before=now, reason=reason,
                   incident=chosen, cause=RestartCause.SDC, rollback_to_step=ck_step)


def rollback_plan(start: int, detected: int, ck_step: int, rec: RecoveryFacts,
                  cfg: PolicyConfig, done: int
                  ) -> tuple[tuple[tuple[int, int], ...], LRSchedule]:
    """The skip range and LR schedule of a rollback past a spike that started at step
    ``start`` and was detected at step ``detected``, after ``done`` earlier rollbacks.

    Skip: from ``rollback_skip_before`` batches before the spike's first batch through the
    detection step's batch (+ ``rollback_skip_after``), or ``rollback_skip_batches`` when
    set; the length doubles on each recurrence; never before the checkpoint's own batch.
    LR: x ``rollback_lr_scale ** (done + 1)`` for ``rollback_lr_ratio`` x the batches
    skipped (or ``rollback_lr_steps``), back over half that (or ``rollback_lr_ramp_steps``)."""
    widen = 2 ** done
    spike_batch = rec.batch_index.get(start, start)
    seen_batch = rec.batch_index.get(detected, spike_batch + (detected - start))
    base = spike_batch - cfg.rollback_skip_before
    if cfg.rollback_skip_batches is not None:
        length = cfg.rollback_skip_batches
    else:
        length = max(1, seen_batch + cfg.rollback_skip_after - base + 1)
    first = max(rec.batch_index.get(ck_step, ck_step), base)
    last = max(first, base + length * widen - 1)
    skipped = last - first + 1
    steps = (cfg.rollback_lr_steps if cfg.rollback_lr_steps is not None
             else math.ceil(cfg.rollback_lr_ratio * skipped))
    ramp = cfg.rollback_lr_ramp_steps if cfg.rollback_lr_ramp_steps is not None else steps // 2
    lr = LRSchedule(scale=cfg.rollback_lr_scale ** (done + 1), steps=steps, ramp_steps=ramp)
    return ((first, last),), lr

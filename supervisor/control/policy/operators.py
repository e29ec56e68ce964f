"""An operator's restart, stop and rollback of a run: at once, outside the budgets."""

from __future__ import annotations

from trainwarden.agent.protocol import LRSchedule
from trainwarden.supervisor.control.policy.core import RunFacts
from trainwarden.supervisor.control.policy.decisions import Decision, Note, Restart, Stop
from trainwarden.supervisor.enums import FINAL_STATUSES, RestartCause, RunStatus, Verdict


def operator_restart(
    run: RunFacts, *, checkpoint: str | None, reason: str, actor: str, now: float,
    step: int | None = None,
) -> Decision:
    """A restart asked for by an operator: no backoff, not counted against the budget.
    ``step``: the step of a checkpoint the operator named; the branch beyond it is abandoned
    (the newest checkpoint is the highest step of the current lineage, so the old branch's
    later saves must not be taken for the newest again)."""
    if run.status in FINAL_STATUSES:
        return Note(Verdict.IGNORED, f"run is {run.status}")
    return Restart(attempt=run.attempt + 1, checkpoint=checkpoint, not_before=now,
                   reason=reason or "operator restart", actor=actor,
                   counts_against_budget=False, rollback_to_step=step)


def operator_stop(run: RunFacts, *, reason: str, actor: str) -> Decision:
    if run.status in FINAL_STATUSES:
        return Note(Verdict.IGNORED, f"run is {run.status}")
    return Stop(status=RunStatus.STOPPED, reason=reason or "operator stop", actor=actor)


def operator_rollback(run: RunFacts, *, checkpoint: str, step: int,
                      skip: tuple[tuple[int, int], ...], lr: LRSchedule | None, reason: str,
                      actor: str, now: float) -> Decision:
    """An operator's rollback: to the named checkpoint, at once, outside the budgets."""
    if run.status in FINAL_STATUSES:
        return Note(Verdict.IGNORED, f"run is {run.status}")
    return Restart(attempt=run.attempt + 1, checkpoint=checkpoint, not_before=now,
                   reason=reason or f"operator rollback to step {step}", actor=actor,
                   counts_against_budget=False, skip=skip, lr=lr, cause=RestartCause.OPERATOR,
                   rollback_to_step=step)

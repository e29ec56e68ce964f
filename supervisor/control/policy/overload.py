"""The supervisor overloaded: an event for each active run, and the batch interval the
ingest reply advises."""

from __future__ import annotations

import math

from trainwarden.supervisor.control.policy.decisions import RecordEvent
from trainwarden.supervisor.detect.overload import OverloadConfig
from trainwarden.supervisor.enums import SupervisorEvent


def advised_batch_interval(*, last_overloaded_at: float | None, now: float,
                           sending_agents: int, cfg: OverloadConfig) -> float | None:
    """The batch interval the ingest reply asks agents to use (None: their own, ~1 s).

    * While the supervisor is behind, and ``cfg.backoff_hold_s`` after (so a recovery is not
      undone at once by the load coming back): ``cfg.batch_interval_s``.
    * Whenever more agents send than ``cfg.max_batches_per_s`` batches a second would
      allow at one batch each a second: agents / that limit (2,048 agents at 500 a second:
      every 4.1 s), so the request rate stays bounded however many nodes a run has.

    Fewer, larger batches: the same rows in a fraction of the requests; nothing is dropped,
    and urgent reports (an exit, a crash) still go at once."""
    every = None
    if last_overloaded_at is not None and now - last_overloaded_at <= cfg.backoff_hold_s:
        every = cfg.batch_interval_s
    if cfg.max_batches_per_s > 0 and sending_agents > cfg.max_batches_per_s:
        share = math.ceil(10 * sending_agents / cfg.max_batches_per_s) / 10
        every = max(every or 0.0, share)
    return every


def on_overload(*, reason: str | None, lateness_s: float | None,
                ended_after_s: float | None) -> RecordEvent:
    """What an overload of the supervisor means for each active run: an event, never an
    incident or a restart (the supervisor's backlog is not the run's fault); the hang,
    node-lost and straggler verdicts are held back meanwhile (``Evaluator._judge_overload``)."""
    if ended_after_s is not None:
        return RecordEvent(
            name=SupervisorEvent.OVERLOAD_ENDED,
            message=f"the supervisor keeps up again after {ended_after_s:.1f} s overloaded; "
                    "hang and node-lost deadlines count from now",
            details={"overloaded_s": round(ended_after_s, 3)})
    return RecordEvent(
        name=SupervisorEvent.OVERLOADED,
        message=f"the supervisor is overloaded ({reason}): hang, node-lost and straggler "
                "verdicts are held back until it keeps up; nothing is restarted for it",
        details={"reason": reason or "", "lateness_s": lateness_s})

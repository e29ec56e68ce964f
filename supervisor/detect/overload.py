"""Overload: the supervisor itself is behind, so silence and slowness it sees are its own.

An overloaded supervisor (ingest requests queued, its event loop starved, its evaluator not
ticking) receives every agent's batches late.  Judged on receive times, healthy nodes then
look lost and healthy runs hung; the gang restarts that follow would make the supervisor's
backlog the run's fault.  While this detector says the supervisor is overloaded, the
evaluator holds back the hang, node-lost and straggler verdicts, and once it recovers it
judges them afresh from the time it recovered (as after a supervisor restart).

Signals (``DeliveryReport``, gathered by
``trainwarden.supervisor.ingest.delivery.DeliveryMonitor``):

* lateness: how much later than usual batches arrive.  Each batch carries the agent's send
  time (``sent_at``, stamped as it is sent); receive time minus send time is the network and
  the supervisor's queue plus the agent's clock offset.  The offset is the smallest
  difference seen from that agent, so lateness = difference - offset needs no synchronised
  clocks.  A high percentile over the recent batches, not the mean: an overload delays most
  batches, a slow link one agent's.
* loop lag: how late the event loop ran a timer it set (a starved loop answers nobody), and
  how long ago it last did (a loop that stopped says nothing at all);
* evaluator gap: how long since the evaluator's previous tick (a process that was stopped
  or starved judges on a view older than its deadlines).

Pure: a report and a config in, a verdict out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainwarden.agent.core.bounds import bounded, check


@dataclass(frozen=True)
class OverloadConfig:
    SECTION: ClassVar[str] = "overload"

    # batches arriving this much later than each agent's usual (lateness_quantile over the
    # last window_s): the supervisor is behind

    # seconds later than usual that mean the supervisor is behind
    lateness_s: float = bounded(3.0, gt=0, hint="try 3")
    # of the recent batches' lateness (0.9: most are late)
    lateness_quantile: float = bounded(0.9, gt=0, le=1, hint="try 0.9")
    # seconds of recent batches the lateness is taken over
    window_s: float = bounded(10.0, gt=0, hint="try 10")
    # fewer recent batches than this: lateness not judged
    min_batches: int = bounded(3, ge=1, hint="try 3")
    # the event loop ran its timer this late, or not for this long
    loop_lag_s: float = bounded(2.0, gt=0, hint="try 2")
    # seconds between two evaluator ticks beyond which it was stalled
    tick_gap_s: float = bounded(10.0, gt=0, hint="try 10")
    # agents are told to batch this often while it is behind
    batch_interval_s: float = bounded(4.0, gt=0, hint="try 4")
    # ... and for this long after its last overloaded tick
    backoff_hold_s: float = bounded(60.0, ge=0, hint="try 60")
    # batches a second the supervisor asks for at most: with more agents sending, each is
    # told to batch every agents / this seconds (0: no limit)
    max_batches_per_s: float = bounded(500.0, ge=0, hint="try 500, or 0 for no limit")

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class DeliveryReport:
    """What the supervisor observed of its own delivery, at one moment."""

    batches: int = 0  # batches received within the window
    agents: int = 0  # agents that sent within the window
    lateness_s: float | None = None  # their lateness at the configured quantile
    loop_lag_s: float | None = None  # the event loop's newest timer lateness
    loop_silent_s: float | None = None  # seconds since the loop last ran its timer
    tick_gap_s: float | None = None  # seconds since the evaluator's previous tick


@dataclass(frozen=True)
class Overload:
    reason: str
    lateness_s: float | None


def judge_overload(rep: DeliveryReport, cfg: OverloadConfig) -> Overload | None:
    """The overload the report shows, or None when the supervisor keeps up."""
    why = []
    if rep.batches >= cfg.min_batches and rep.lateness_s is not None \
            and rep.lateness_s > cfg.lateness_s:
        why.append(f"batches arrive {rep.lateness_s:.1f} s later than usual "
                   f"(p{round(100 * cfg.lateness_quantile)} of {rep.batches} in the last "
                   f"{cfg.window_s:g} s; limit {cfg.lateness_s:g} s)")
    if rep.loop_lag_s is not None and rep.loop_lag_s > cfg.loop_lag_s:
        why.append(f"the event loop ran {rep.loop_lag_s:.1f} s late")
    if rep.loop_silent_s is not None and rep.loop_silent_s > cfg.loop_lag_s:
        why.append(f"the event loop has not run for {rep.loop_silent_s:.1f} s")
    if rep.tick_gap_s is not None and rep.tick_gap_s > cfg.tick_gap_s:
        why.append(f"the evaluator did not tick for {rep.tick_gap_s:.1f} s")
    return Overload(reason="; ".join(why), lateness_s=rep.lateness_s) if why else None

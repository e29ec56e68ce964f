"""Whether the supervisor keeps up with its agents, judged once a tick (``OverloadWatch``).

The verdict is ``trainwarden.supervisor.detect.overload``'s, over what the ingest path
observed of its own delivery (``trainwarden.supervisor.ingest.delivery``) and the gap between
ticks; this module keeps what it needs between ticks: since when the supervisor is behind, the
newest tick that found it behind, and the batch interval the ingest replies ask for
(``policy.advised_batch_interval``).  While overloaded, the evaluator holds back the hang,
node-lost and straggler verdicts: what arrives late says nothing of when it happened.
"""

from __future__ import annotations

import logging
import time

from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.detect.overload import (
    DeliveryReport,
    Overload,
    OverloadConfig,
    judge_overload,
)
from trainwarden.supervisor.ingest.delivery import DeliveryMonitor

log = logging.getLogger("trainwarden.evaluator")


class OverloadWatch:
    def __init__(self, cfg: OverloadConfig, delivery: DeliveryMonitor | None) -> None:
        self.cfg = cfg
        # the gap between ticks is timed on the delivery monitor's clock (one clock for the
        # supervisor's own timing)
        self.monotonic: Clock = delivery.monotonic if delivery is not None else time.monotonic
        self.delivery = delivery  # how late batches arrive (None: not watched)
        self.verdict: Overload | None = None  # the supervisor is behind (the last tick's)
        self.since: float | None = None
        self.last_overloaded_at: float | None = None  # the newest tick that found it behind
        self.advice: float | None = None  # the batch interval replies ask for (each tick)
        self._last_tick: float | None = None  # (monotonic) start of the previous tick

    def judge(self, now: float) -> tuple[bool, float | None]:
        """This tick's verdict; returns whether an overload has just started, and the length
        of one that has just ended."""
        mono = self.monotonic()
        gap = None if self._last_tick is None else mono - self._last_tick
        self._last_tick = mono
        rep = (self.delivery.report(now, tick_gap_s=gap) if self.delivery is not None
               else DeliveryReport(tick_gap_s=gap))
        self.verdict = judge_overload(rep, self.cfg)
        if self.verdict is not None:
            self.last_overloaded_at = now
        self.advice = policy.advised_batch_interval(
            last_overloaded_at=self.last_overloaded_at, now=now, sending_agents=rep.agents,
            cfg=self.cfg)
        if self.verdict is not None:
            if self.since is None:
                self.since = now
                log.warning("supervisor overloaded: %s; hang, node-lost and straggler "
                            "verdicts are held back until it keeps up", self.verdict.reason)
                return True, None
            return False, None
        if self.since is None:
            return False, None
        lasted = now - self.since
        self.since = None
        log.warning("supervisor keeps up again after %.1f s overloaded; hang and node-lost "
                    "deadlines count from now", lasted)
        return False, lasted

    def forget_gap(self) -> None:
        """The next tick's gap is not measured (a replica that has just become the leader)."""
        self._last_tick = None

    def state(self, now: float) -> tuple[bool, float | None]:
        """(overloaded at the last tick, batch lateness now): what /metrics exports."""
        rep = self.delivery.report(now) if self.delivery is not None else None
        return self.verdict is not None, rep.lateness_s if rep is not None else None

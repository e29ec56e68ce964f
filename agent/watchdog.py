"""The agent's own hang watchdog: the same statistic as the supervisor's, on what this node sees.

The supervisor decides hangs for the whole run; this watchdog exists for when it cannot: while
the supervisor is unreachable a hung run would otherwise sit stuck (gloo waits 30 minutes on a
collective by default).  The agent acts on a finding only when the supervisor has been silent
for longer than the deadline itself; otherwise it leaves the decision to the supervisor.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from trainwarden.agent.core.findings import Finding, FindingKind
from trainwarden.agent.core.hang import (
    HangConfig,
    ProgressWindow,
    RankProgress,
    detect_hang,
    learned_deadline,
)
from trainwarden.agent.protocol import WorkerEventName


class HangWatch:
    """Feeds on the step reports of the local workers; ``check(now)`` -> a hang or None."""

    def __init__(self, cfg: HangConfig | None = None, history: int = 300) -> None:
        self.cfg = cfg or HangConfig()
        self.attempt = 0
        self.attempt_started_at = 0.0
        self.ranks: dict[int, RankProgress] = {}
        self.steps_in_attempt = 0
        self._step_times: dict[int, float] = {}  # step -> latest end time over local ranks
        self.intervals: deque[float] = deque(maxlen=history)
        self.checkpoint_since: float | None = None
        self.recent_save_s: deque[float] = deque(maxlen=10)
        self.finished_at: float | None = None  # a local rank's training loop reported done

    def new_attempt(self, attempt: int, now: float) -> None:
        self.attempt, self.attempt_started_at = attempt, now
        self.ranks.clear()
        self.steps_in_attempt = 0
        self._step_times.clear()
        self.checkpoint_since = None
        self.finished_at = None

    def observe(self, msg: dict[str, Any]) -> None:
        if msg.get("attempt", self.attempt) != self.attempt:
            return
        kind = msg.get("type")
        if kind == "step":
            rank, step, t = msg.get("rank"), msg.get("step"), msg.get("t")
            if not isinstance(rank, int) or not isinstance(step, int) or \
                    not isinstance(t, int | float):
                return
            prev = self.ranks.get(rank)
            if prev is None or step >= prev.step:
                self.ranks[rank] = RankProgress(step, float(t))
            if step not in self._step_times:
                self.steps_in_attempt += 1
                before = self._step_times.get(step - 1)
                if before is not None and t > before:
                    self.intervals.append(float(t) - before)
                self._step_times[step] = float(t)
                if len(self._step_times) > 8:
                    del self._step_times[min(self._step_times)]
        elif kind == "event" and msg.get("name") == WorkerEventName.CHECKPOINT_STARTED:
            self.checkpoint_since = float(msg.get("t") or 0.0)
        elif kind == "event" and msg.get("name") == WorkerEventName.FINISHED \
                and self.finished_at is None:
            self.finished_at = float(msg.get("t") or 0.0)
        elif kind == "checkpoint":
            self.checkpoint_since = None
            if isinstance(msg.get("save_s"), int | float):
                self.recent_save_s.append(float(msg["save_s"]))

    def check(self, now: float) -> Finding | None:
        window = ProgressWindow(
            attempt_started_at=self.attempt_started_at, ranks=dict(self.ranks),
            steps_in_attempt=self.steps_in_attempt, step_intervals=list(self.intervals),
            checkpoint_since=self.checkpoint_since, recent_save_s=list(self.recent_save_s),
            finished_at=self.finished_at)
        for f in detect_hang(window, now, self.cfg):
            if f.kind == FindingKind.HANG:
                return f
        return None

    def deadline_s(self) -> float:
        """The learned steady deadline, or the floor (how long the supervisor may be silent
        before this watchdog acts on its own)."""
        window = ProgressWindow(attempt_started_at=self.attempt_started_at,
                                step_intervals=list(self.intervals))
        return learned_deadline(window, self.cfg) or self.cfg.floor_s

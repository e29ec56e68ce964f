"""What the supervisor observes of its own delivery: how late agents' batches arrive and
whether its event loop keeps time (the inputs of ``trainwarden.supervisor.detect.overload``).

Ingest calls ``observe`` for every batch (a few dict and deque operations, no I/O); a task
on the event loop calls ``loop_beat`` a few times a second; the evaluator asks for a
``report``.  Thread-safe: the three run on different threads."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque

from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.detect.overload import DeliveryReport, OverloadConfig

MAX_AGENTS = 65_536  # clock offsets kept (one per agent); beyond, the oldest go
MAX_SAMPLES = 20_000  # batches kept for the lateness quantile (about 10 s at 2,048 agents)
LOOP_BEAT_S = 0.25


class DeliveryMonitor:
    """``monotonic``: the clock the event loop's lag is measured with (``time.monotonic`` in
    production; a world driven by a fake wall clock passes one that stands still)."""

    def __init__(self, cfg: OverloadConfig | None = None, *,
                 monotonic: Clock = time.monotonic) -> None:
        self.cfg = cfg or OverloadConfig()
        self.monotonic = monotonic
        self._lock = threading.Lock()
        self._offset: dict[int, float] = {}  # agent id -> smallest receive - send seen
        self._heard: dict[int, float] = {}  # agent id -> its newest batch's receive time
        self._recent: deque[tuple[float, float]] = deque(maxlen=MAX_SAMPLES)
        self._beat_at: float | None = None  # (monotonic) when the loop last ran its timer
        self._beat_lag = 0.0

    def observe(self, agent_id: int, sent_at: float | None, received_at: float) -> None:
        """One batch of ``agent_id`` stamped ``sent_at`` by the agent, received now."""
        if sent_at is None or not math.isfinite(sent_at):
            return
        raw = received_at - sent_at
        with self._lock:
            off = self._offset.get(agent_id)
            if off is None or raw < off:
                if off is None and len(self._offset) >= MAX_AGENTS:
                    self._offset.pop(next(iter(self._offset)))
                off = self._offset[agent_id] = raw
            self._recent.append((received_at, raw - off))
            if agent_id not in self._heard and len(self._heard) >= MAX_AGENTS:
                self._heard.pop(next(iter(self._heard)))
            self._heard[agent_id] = received_at

    def loop_beat(self, lag_s: float, at: float | None = None) -> None:
        """The event loop ran its timer ``lag_s`` late (``at``: monotonic time, for tests)."""
        with self._lock:
            self._beat_at = self.monotonic() if at is None else at
            self._beat_lag = max(0.0, lag_s)

    def report(self, now: float, *, tick_gap_s: float | None = None,
               monotonic: float | None = None) -> DeliveryReport:
        """The report at ``now`` (the clock ingest stamps receive times with)."""
        mono = self.monotonic() if monotonic is None else monotonic
        cfg = self.cfg
        with self._lock:
            while self._recent and self._recent[0][0] < now - cfg.window_s:
                self._recent.popleft()
            late = sorted(x for _, x in self._recent)
            since = now - cfg.window_s
            agents = sum(1 for t in self._heard.values() if t >= since)
            beat_at, beat_lag = self._beat_at, self._beat_lag
        q = None
        if late:
            q = late[min(len(late) - 1, max(0, math.ceil(cfg.lateness_quantile * len(late)) - 1))]
        return DeliveryReport(
            batches=len(late), agents=agents, lateness_s=q,
            loop_lag_s=None if beat_at is None else beat_lag,
            loop_silent_s=None if beat_at is None else max(0.0, mono - beat_at),
            tick_gap_s=tick_gap_s)

    async def beat_forever(self) -> None:
        """Measure the event loop's timer lateness until cancelled."""
        while True:
            t = self.monotonic()
            await asyncio.sleep(LOOP_BEAT_S)
            self.loop_beat(self.monotonic() - t - LOOP_BEAT_S)

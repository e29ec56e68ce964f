"""The live goodput of the runs this process watches (``GoodputFeed``): each tick feeds every
active run's ``LiveGoodput`` with the rows it gained since the last one; the API, the
dashboard and ``/metrics`` read it at any time (a lock between the loop and the readers).

A run that ends is accounted up to its end and kept (the newest ``ENDED_KEPT``), so its page
still shows where its time went.  On a replica that has just become the leader, or after a
supervisor restart, the accounting starts over from the rows in the store.
"""

from __future__ import annotations

import threading
from typing import Any

from trainwarden.supervisor.goodput.live import STEP_ROWS_PER_TICK, LiveGoodput
from trainwarden.supervisor.store import goodput as goodput_store
from trainwarden.supervisor.store import registry
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import RunRow


class GoodputFeed:
    ENDED_KEPT = 256

    def __init__(self) -> None:
        self._active: dict[int, LiveGoodput] = {}
        self._ended: dict[int, LiveGoodput] = {}  # runs that ended while watched, newest kept
        # run id -> the newest heartbeat of any of its agents, as read at the last update
        self.newest_heartbeat: dict[int, float | None] = {}
        self._lock = threading.Lock()  # the API reads what the loop feeds

    def live(self, run_id: int) -> LiveGoodput | None:
        """The active run's accounting (None: not fed yet, or started over)."""
        return self._active.get(run_id)

    def update(self, conn: Connection, run: RunRow, *, ended_at: float | None = None,
               now: float | None = None) -> None:
        """Feed the run's live ETTR with the rows it gained since the last tick."""
        run_id = int(run["id"])
        g = self._active.get(run_id)
        if g is None:
            g = LiveGoodput(start=float(run["created_at"]))
            with self._lock:
                self._active[run_id] = g
        upto, steps = goodput_store.rank_step_groups_after(
            conn, run_id=run_id, after_id=g.step_id, limit=STEP_ROWS_PER_TICK)
        if sum(len(x[3]) for x in steps) == STEP_ROWS_PER_TICK:
            ended_at = None  # still catching up: end it once every step is in
        world = goodput_store.rank_count(conn, run_id=run_id)
        ckpts = goodput_store.checkpoints_after(conn, run_id=run_id, after_id=g.checkpoint_id)
        incs = goodput_store.incidents_after(conn, run_id=run_id, after_id=g.incident_id)
        acts = goodput_store.restart_actions_after(conn, run_id=run_id, after_id=g.action_id,
                                                   pending=g.pending_actions)
        presence_upto, presence = goodput_store.presence_events_after(
            conn, run_id=run_id, after_id=g.event_id)
        self.newest_heartbeat[run_id] = goodput_store.newest_heartbeat(conn, run_id=run_id)
        with self._lock:
            g.update(steps=steps, steps_upto=upto, world=world, checkpoints=ckpts, incidents=incs,
                     actions=acts, presence=presence, presence_upto=presence_upto,
                     ended_at=ended_at, now=now)

    def start_over(self, run_id: int) -> None:
        """Drop the run's accounting (it failed): the next update starts from the store."""
        with self._lock:
            self._active.pop(run_id, None)

    def end(self, conn: Connection, run_id: int) -> None:
        """The run is no longer active: account it up to its end and keep it."""
        self.newest_heartbeat.pop(run_id, None)
        run = registry.get_run(conn, run_id=run_id)
        if run is None or run_id not in self._active:
            self.start_over(run_id)
            return
        self.update(conn, run, ended_at=float(run["updated_at"]))
        with self._lock:
            self._ended[run_id] = self._active.pop(run_id)
            while len(self._ended) > self.ENDED_KEPT:
                self._ended.pop(next(iter(self._ended)))

    def _of(self, run_id: int) -> LiveGoodput | None:
        g = self._active.get(run_id)
        return g if g is not None else self._ended.get(run_id)

    def series(self, run_id: int, now: float, window_s: float) -> dict[str, Any] | None:
        """``LiveGoodput.series`` now; None when this process has not accounted the run."""
        with self._lock:
            g = self._of(run_id)
            return None if g is None else g.series(now, window_s)

    def snapshot(self, run_id: int, now: float) -> dict[str, Any] | None:
        """The run's live ETTR and badput by cause (``LiveGoodput.as_dict``) now; None when
        this process has not accounted the run (not yet ticked, or it ended before)."""
        with self._lock:
            g = self._of(run_id)
            return None if g is None else g.as_dict(now)

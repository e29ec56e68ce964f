"""Which supervisor replica runs the evaluator, and the loop that ticks it only there.

On Postgres several replicas may share one database: every one serves ingest, the API, the
dashboard and ``/metrics``, and exactly one at a time runs the evaluator (detection and the
policy), the holder of the evaluator lease (``store.lease``).  ``Leadership`` renews the
lease every ``renew_s`` while it holds it, and tries to take it as often while it does not;
a leader that stops renewing (killed, wedged, cut off from the database) loses it
``duration_s`` after its last renewal, and one that shuts down cleanly releases it at once.

Every write transaction of the evaluator's tick runs the fence first
(``Database.fenced`` with ``Leadership.fence``): it checks, under a row lock on the lease,
that the lease's epoch is still this replica's.  A deposed leader's late decision (its tick
began before a standby took the lease) is refused by the store, rolled back and logged, and
the replica steps down; so an action is never decided twice, whatever the timing.

A replica that becomes leader observes the runs from then on (``Evaluator.observing_since``):
the seconds no evaluator ran (the old leader's death, the lease's expiry) are not a hang or
a lost node of a healthy run.

On SQLite (one process) the lease is trivially held: no lease row, no fence, and the
evaluator's own loop (``Evaluator.start``) ticks as it always did.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, ClassVar, TypedDict

from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store import lease
from trainwarden.supervisor.store.db import Connection, Database

log = logging.getLogger("trainwarden.leader")


@dataclass(frozen=True)
class LeaseConfig:
    SECTION: ClassVar[str] = "lease"

    # Postgres replicas: a leader that has not renewed for this long (killed, wedged, cut off
    # from the database) loses the evaluator lease to a standby
    duration_s: float = bounded(6.0, gt=0)
    # Postgres replicas: how often the leader renews the lease and a standby tries to take it
    renew_s: float = bounded(1.0, gt=0)

    def __post_init__(self) -> None:
        check(self)
        cross_check(self.duration_s >= 2 * self.renew_s, self, "duration_s",
                    f">= 2 x renew_s = {2 * self.renew_s:g}", got=self.duration_s,
                    hint="so that one late renewal does not hand the evaluator to a standby: "
                         f"raise duration_s to {2 * self.renew_s:g} or more, or lower renew_s")

    @property
    def takeover_bound_s(self) -> float:
        """How long after a leader's death a standby leads at the latest (its lease expires,
        then the standby's next try): what an operator can expect without a clean release."""
        return self.duration_s + self.renew_s


class LeaderStatus(TypedDict):
    replica: str  # this replica's id (host:pid:nonce)
    leader: bool  # whether this replica runs the evaluator now
    epoch: int | None  # the lease epoch it leads under (None: standby; 0 on SQLite)
    since: float | None  # since when it leads (unix seconds)
    shared: bool  # whether the store is shared by replicas (Postgres): a lease is held


def replica_id() -> str:
    """host:pid:nonce (the nonce tells a restarted process with a reused pid apart)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class Leadership:
    """This replica's part in the evaluator lease."""

    def __init__(self, db: Database, cfg: LeaseConfig | None = None, *,
                 holder: str | None = None, clock: Clock = time.time) -> None:
        self.db = db
        self.cfg = cfg or LeaseConfig()
        self.holder = holder or replica_id()
        self.clock = clock
        self.shared = not db.is_sqlite
        self._lock = threading.Lock()
        self.epoch: int | None = None if self.shared else 0
        self.since: float | None = None if self.shared else clock()
        self._next_try = float("-inf")  # time.monotonic() of the next renewal or try
        self._renewed = float("-inf")  # time.monotonic() of the last renewal that held

    @property
    def leading(self) -> bool:
        return self.epoch is not None

    def status(self) -> LeaderStatus:
        with self._lock:
            return {"replica": self.holder, "leader": self.epoch is not None,
                    "epoch": self.epoch, "since": self.since, "shared": self.shared}

    def step(self) -> bool:
        """Renew the lease (leader) or try to take it (standby) when ``renew_s`` has passed
        since the last time; returns whether this replica leads now."""
        if not self.shared:
            return True
        mono = time.monotonic()
        if mono < self._next_try:
            return self.leading
        self._next_try = mono + self.cfg.renew_s
        try:
            with self.db.write() as conn:
                now = lease.database_time(conn) or self.clock()
                if self.epoch is not None:
                    if lease.renew(conn, holder=self.holder, epoch=self.epoch, now=now,
                                   duration_s=self.cfg.duration_s):
                        self._renewed = mono
                        return True
                    self._step_down("its renewal was refused: a standby took the lease")
                got = lease.acquire(conn, holder=self.holder, now=now,
                                    duration_s=self.cfg.duration_s)
        except Exception as e:  # the store is unreachable: neither renewed nor taken
            log.warning("evaluator lease: %s: %s", type(e).__name__, e)
            if self.epoch is not None and mono - self._renewed > self.cfg.duration_s:
                # Our lease has surely expired: a standby may lead by now.
                self._step_down(f"no renewal for {mono - self._renewed:.1f} s")
            return self.leading
        if got is not None:
            with self._lock:
                self.epoch, self.since = int(got["epoch"]), self.clock()
            self._renewed = mono
            log.warning("replica %s leads the evaluator (lease epoch %d)", self.holder,
                        self.epoch)
        return self.leading

    def _step_down(self, why: str) -> None:
        with self._lock:
            if self.epoch is None:
                return
            log.warning("replica %s no longer leads the evaluator (epoch %d): %s",
                        self.holder, self.epoch, why)
            self.epoch, self.since = None, None

    def deposed(self, why: str) -> None:
        """The store refused a decision of this replica's (``lease.Fenced``)."""
        self._step_down(why)
        self._next_try = float("-inf")  # see at once whether the lease is free again

    def fence(self, conn: Connection) -> None:
        """The check every evaluator write transaction runs first (``Database.fenced``)."""
        epoch = self.epoch
        if epoch is None:
            raise lease.Fenced(name=lease.EVALUATOR, epoch=-1, current=lease.current(conn))
        if self.shared:
            lease.check_epoch(conn, epoch=epoch, hold_s=self.cfg.duration_s)

    def release(self) -> None:
        """Hand the lease back (a clean shutdown): a standby takes it on its next try."""
        if not self.shared or self.epoch is None:
            return
        epoch = self.epoch
        try:
            with self.db.write() as conn:
                now = lease.database_time(conn) or self.clock()
                lease.release(conn, holder=self.holder, epoch=epoch, now=now)
        except Exception as e:
            log.warning("evaluator lease not released (%s: %s): a standby takes it once it "
                        "expires", type(e).__name__, e)
        self._step_down("released (shutdown)")


class LedEvaluator:
    """The evaluator's loop on a shared store: tick every ``interval_s`` while this replica
    leads, the lease renewed (or tried) every ``renew_s`` in between."""

    def __init__(self, evaluator: Evaluator, leadership: Leadership, interval_s: float) -> None:
        self.evaluator = evaluator
        self.leadership = leadership
        self.interval_s = interval_s
        # Every write transaction of the tick checks the lease epoch first.
        evaluator.db = evaluator.db.fenced(leadership.fence)
        # The lease is renewed while a tick waits on the observer process too (a child
        # starting up takes seconds on a busy machine, more than the lease lasts).
        evaluator.keepalive = leadership.step
        self._led_epoch: int | None = None
        self.fenced = 0  # decisions the store refused (a deposed leader's)

    def run(self, stop: threading.Event) -> None:
        next_tick = time.monotonic() + self.interval_s
        try:
            while True:
                self.once(next_tick <= time.monotonic())
                if next_tick <= time.monotonic():
                    next_tick = time.monotonic() + self.interval_s
                wait = min(next_tick - time.monotonic(), self.leadership.cfg.renew_s)
                if stop.wait(max(0.01, wait)):
                    return
        finally:
            self.leadership.release()
            self.evaluator.observer.close()

    def once(self, tick: bool) -> Any:
        """Renew or try the lease; tick when ``tick`` and leading.  Returns the tick's
        report, or None."""
        leading = self.leadership.step()
        if not leading:
            self._led_epoch = None
            return None
        if self.leadership.epoch != self._led_epoch:
            # A new term: observe from now on (the gap without an evaluator is no run's
            # fault).
            self._led_epoch = self.leadership.epoch
            self.evaluator.observe_from_now()
        if not tick:
            return None
        try:
            return self.evaluator.tick()
        except lease.Fenced as e:
            self.fenced += 1
            log.error("evaluator decision refused by the store: %s", e)
            self.leadership.deposed(str(e))
        except Exception:
            log.exception("evaluator tick failed")
        return None

    def start(self) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        th = threading.Thread(target=self.run, args=(stop,), name="trainwarden-evaluator",
                              daemon=True)
        th.start()
        return th, stop

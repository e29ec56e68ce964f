"""The detectors over every active run: reads only, findings out (``Observer``), in the
evaluator's thread or in a process of its own (``ObserverProcess``).

The detectors' work grows with the run (thousands of ranks' windows each tick) and is pure
Python: in the supervisor's process it holds the interpreter lock while ingest needs it,
and every lock hand-over costs ingest up to the switch interval (5 ms) per socket or
database call.  In a process of its own, it costs ingest nothing; the evaluator's thread
keeps the decisions (the policy and the write transaction) and the goodput accounting the
API reads.  The child reads the same database (SQLite in WAL mode, or Postgres) through
its own connections; it keeps the per-run state between ticks (the incremental straggler
window, the straggler pacing, the loss cursor), exactly as the in-thread observer does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainwarden.supervisor import heap
from trainwarden.supervisor.control.detection import (
    DetectionConfig,
    PhaseWindow,
    attempt_started_at,
    disk_findings,
    hang_findings,
    loss_findings,
    loss_rows,
    lost_node_findings,
    restart_seconds,
    straggler_findings,
    throughput_findings,
    with_spike_cost,
)
from trainwarden.supervisor.detect import Finding
from trainwarden.supervisor.enums import IncidentKind, IncidentStatus
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry, windows
from trainwarden.supervisor.store.db import Connection, Database, make_database
from trainwarden.supervisor.store.rows import RunRow

log = logging.getLogger("trainwarden.observer")

CHILD_NICE = 10  # the detectors' process yields the CPU to ingest when both want it

@dataclass
class Observation:
    """What the detectors found for one run's attempt (read outside the write lock)."""

    attempt: int
    findings: list[Finding]
    stragglers: dict[int | None, Finding] | None  # None: not looked at this tick


@dataclass(frozen=True)
class ObserveRequest:
    """One tick's question: the evaluator's clock and what it knows of its own delivery."""

    now: float
    observing_since: float  # hangs and lost nodes are judged on what it could observe
    # overloaded: no hang, node-lost or straggler judgment (trainwarden.supervisor.detect.overload)
    held: bool
    batch_interval_s: float | None  # the interval agents were asked to batch at (None: theirs)


@dataclass
class _RunState:
    window: PhaseWindow  # per-rank pre-collective times, read incrementally
    straggler_at: float = -math.inf  # when its stragglers were last judged ...
    straggler_cost_s: float = 0.0  # ... and how long that took
    loss_seen: tuple[int, int] | None = None  # (attempt, newest step) of the last loss look


@dataclass
class Observer:
    """The detectors of every active run, with what they keep between ticks."""

    detection: DetectionConfig
    _runs: dict[int, _RunState] = field(default_factory=dict)

    def observe(self, db: Database, req: ObserveRequest,
                keepalive: Callable[[], object] | None = None) -> dict[int, Observation]:
        """The detectors' verdicts (``keepalive``: unused here, see ``ObserverProcess``)."""
        with db.read() as conn:
            return self.observe_on(conn, req)

    def observe_on(self, conn: Connection, req: ObserveRequest) -> dict[int, Observation]:
        active = registry.active_runs(conn)
        for gone in self._runs.keys() - {int(r["id"]) for r in active}:
            del self._runs[gone]
        out = {}
        for run in active:
            obs = self._observe(conn, run, self._state(run), req)
            if obs is not None:
                out[int(run["id"])] = obs
        return out

    def close(self) -> None:
        pass

    def _state(self, run: RunRow) -> _RunState:
        state = self._runs.get(int(run["id"]))
        if state is None:
            state = self._runs[int(run["id"])] = _RunState(
                PhaseWindow(self.detection.straggler_table_steps))
        return state

    def _observe(self, conn: Connection, run: RunRow, state: _RunState, req: ObserveRequest
                 ) -> Observation | None:
        cfg, now = self.detection, req.now
        started = attempt_started_at(conn, run)
        agents = windows.agent_liveness(conn, run_id=run["id"])
        if started is None:
            # A restart is under way: the new attempt is judged once it runs.  Only a member
            # not heard from since the restart was decided is, once that silence passes the
            # deadline: the restart waits on it (its agent never takes the command), and the
            # policy gives its rank to a spare.
            pending = rec.restart_action_for(conn, run_id=run["id"], attempt=run["attempt"])
            if pending is None or req.held:
                return None
            decided = float(pending["created_at"])
            lost = lost_node_findings(
                conn, run, now=now, cfg=cfg,
                agents=[a for a in agents if float(a["last_seen_at"]) < decided],
                observing_since=max(req.observing_since, decided),
                batch_interval_s=req.batch_interval_s)
            return Observation(attempt=int(run["attempt"]), findings=lost, stragglers=None)
        since = max(req.observing_since, started)
        findings: list[Finding] = []
        if not req.held:
            # agents told to batch less often deliver less often: the deadlines allow for it
            findings += hang_findings(conn, run, now=now,
                                              observing_since=req.observing_since, cfg=cfg,
                                              agents=agents, started=started,
                                              batch_interval_s=req.batch_interval_s)
            findings += lost_node_findings(conn, run, now=now, observing_since=since,
                                                   cfg=cfg, agents=agents,
                                                   batch_interval_s=req.batch_interval_s)
        slow: dict[int | None, Finding] | None = None
        if not req.held and now - state.straggler_at >= max(
                cfg.straggler_interval_s, cfg.straggler_cost_factor * state.straggler_cost_s):
            t0 = time.perf_counter()
            open_stragglers = {int(i["rank"]) for i in rec.incidents_of(
                conn, run_id=run["id"], kinds=[IncidentKind.STRAGGLER],
                status=IncidentStatus.OPEN)
                if i["rank"] is not None}
            stragglers = straggler_findings(conn, run, cfg=cfg,
                                                    open_ranks=open_stragglers,
                                                    window=state.window)
            findings += stragglers
            slow = {f.rank: f for f in stragglers}
            state.straggler_at, state.straggler_cost_s = now, time.perf_counter() - t0
        seen = state.loss_seen
        rows = loss_rows(conn, run, cfg=cfg, seen_step=seen[1] if seen and
                                 seen[0] == int(run["attempt"]) else None)
        if rows:
            state.loss_seen = (int(run["attempt"]), int(rows[-1]["step"]))
        findings += with_spike_cost(loss_findings(rows, cfg=cfg), rows,
                                    lambda: restart_seconds(conn, run))
        findings += throughput_findings(rows, cfg=cfg)
        findings += disk_findings(conn, run, cfg=cfg, agents=agents)
        return Observation(attempt=int(run["attempt"]), findings=findings, stragglers=slow)


def can_run_apart(url: str) -> bool:
    """Whether another process can open the database (not an in-memory SQLite one)."""
    return not (url.startswith("sqlite") and (url.rstrip("/") in ("sqlite:", "sqlite:/")
                                                or ":memory:" in url or "mode=memory" in url))


KEEPALIVE_S = 0.2  # while waiting for the child's answer, the waiter's keepalive this often


class ObserverProcess:
    """An ``Observer`` in a child process (spawned: no state inherited), asked once a tick.

    A child that dies, or does not answer within ``timeout_s``, is replaced at the next
    tick; that tick has no observations (the decisions on exits and events go on)."""

    def __init__(self, url: str, detection: DetectionConfig, *,
                 timeout_s: float = 30.0) -> None:
        self.url, self.detection, self.timeout_s = url, detection, timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: Any = None
        self._conn: multiprocessing.connection.Connection | None = None

    def _start(self) -> multiprocessing.connection.Connection:
        parent, child = self._ctx.Pipe()
        self._proc = self._ctx.Process(target=_child_main, args=(child, self.url, self.detection),
                                       name="trainwarden-observer", daemon=True)
        self._proc.start()
        child.close()
        self._conn = parent
        return parent

    def observe(self, _db: Database, req: ObserveRequest,
                keepalive: Callable[[], object] | None = None
                ) -> dict[int, Observation] | None:
        """The child's verdicts; ``keepalive`` is called every ``KEEPALIVE_S`` while waiting
        for them (a leader renews its lease there: a child starting up, seconds on a busy
        machine, must not hand the evaluator to a standby)."""
        conn = self._conn if self._conn is not None else self._start()
        try:
            conn.send(req)
            deadline = time.monotonic() + self.timeout_s
            while not conn.poll(max(0.0, min(KEEPALIVE_S, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"no answer within {self.timeout_s:g} s")
                if keepalive is not None:
                    keepalive()
            reply = conn.recv()
        except (OSError, EOFError, TimeoutError) as e:
            log.error("observer process failed (%s); a new one starts at the next tick", e)
            self.close()
            return None
        if isinstance(reply, BaseException):
            log.error("observer process: %r", reply)
            return None
        assert isinstance(reply, dict)
        return reply

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.send(None)
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.join(timeout=5)
            if self._proc.is_alive():
                self._proc.kill()
            self._proc = None


def _child_main(conn: multiprocessing.connection.Connection, url: str,
                detection: DetectionConfig) -> None:
    # Below ingest on a busy machine: a detector's verdict can wait milliseconds for a
    # core, an agent's batch should not.
    with contextlib.suppress(OSError):
        os.nice(CHILD_NICE)
    db = make_database(url, pool_size=2)
    observer = Observer(detection)
    heap.settle()  # its windows are long-lived too: see trainwarden.supervisor.heap
    try:
        while True:
            try:
                req = conn.recv()
            except EOFError:
                return
            if req is None:
                return
            try:
                out: Any = observer.observe(db, req)
            except Exception as e:  # said to the evaluator, which logs it; the child goes on
                out = RuntimeError(f"observation failed: {type(e).__name__}: {e}")
            conn.send(out)
    finally:
        db.dispose()

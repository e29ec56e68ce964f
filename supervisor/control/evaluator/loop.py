"""The evaluation loop: ``tick()`` reads the store, asks the policy, writes actions.

``tick`` observes first, in a read transaction: the detectors' windows (per-rank timings of
the newest steps, losses, progress) are the expensive part, thousands of rows for a big run,
and reading them inside the write transaction held the store's one writer (and with it every
agent's ingest) for the whole tick.  Then one short write transaction, in steps: the agents'
exit reports (``_exits``), the progress of the actions under way, the workers' failure events
and stack dumps, the findings (a finding observed for an attempt the run has left by then is
dropped: the next tick observes the new one), the checkpoints to protect, and last the health
ledger (``control.ledger``: the evidence against nodes those steps left, and the cordons it
calls for).  What the
evaluator keeps of a run between ticks is one ``RunState``.  ``run`` is a thin loop around
``tick`` (a daemon thread started by the app); the clock is injected so tests drive exactly
one tick at a chosen time.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from trainwarden.supervisor.control import actions, policy
from trainwarden.supervisor.control.detection import lost_deadline
from trainwarden.supervisor.control.evaluator.base import TickReport
from trainwarden.supervisor.control.evaluator.exits import ExitJudge
from trainwarden.supervisor.control.evaluator.findings import FindingJudge
from trainwarden.supervisor.control.evaluator.membership import MembershipJudge
from trainwarden.supervisor.control.ledger import LedgerTick
from trainwarden.supervisor.control.observer import Observation, ObserveRequest
from trainwarden.supervisor.detect.node_lost import agents_gone
from trainwarden.supervisor.enums import ActionKind, IncidentStatus, JudgeStage, SupervisorEvent
from trainwarden.supervisor.store import credentials, registry
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import RunRow

log = logging.getLogger("trainwarden.evaluator")


class Evaluator(ExitJudge, MembershipJudge, FindingJudge):
    """The evaluation loop: ``tick`` observes, then judges every active run in one write
    transaction (exits, actions, worker events, findings, upkeep, the health ledger)."""

    def tick(self) -> TickReport:
        now = self.clock()
        rep = TickReport()
        started, ended = self._judge_overload(now)
        observed = self._observe_active(now)
        # What the write transaction reads (an exit, a worker event) may have been stored
        # while the detectors ran (a new leader's first tick starts the observer process):
        # what it decides is dated from now, never before what it acts on.
        now = max(now, self.clock())
        self._failed_this_tick = set()
        with self.db.write() as conn:
            if started or ended is not None:
                self._record_overload(conn, now, ended)
            self._exits(conn, now, rep)
            for action in rec.actions_in_progress(conn):
                with self._contained(conn, int(action["run_id"]), JudgeStage.ACTIONS, now):
                    if actions.advance(conn, action=action, now=now) != action["status"]:
                        rep.advanced += 1
            self._worker_events(conn, now, rep)
            for run in registry.active_runs(conn):
                obs = observed.get(int(run["id"]))
                if obs is not None and obs.attempt == int(run["attempt"]):
                    with self._contained(conn, int(run["id"]), JudgeStage.FINDINGS, now):
                        self._act_on(conn, run, obs, now, rep)
            # The health ledger before the upkeep: a node its evidence cordons (the failure
            # just decided on, say) is replaced before the restart it is a member of trains.
            ledger = self._ledger(conn, now)
            busy = {int(a["run_id"]) for a in rec.actions_in_progress(conn)}
            for run in registry.active_runs(conn):
                with self._contained(conn, int(run["id"]), JudgeStage.UPKEEP, now):
                    rec.abandon_branches(conn, run_id=run["id"])  # late checkpoints of old ones
                    self._protect(conn, run)
                    self._attempt_mismatches(conn, run, int(run["id"]) in busy, now, rep)
                    self._presence(conn, run, now)
                    self._fill_missing(conn, run, now, rep)
                    self._replace_cordoned(conn, run, now, rep)
                    self._grow_back(conn, run, int(run["id"]) in busy, now, rep)
            self._revoke_ended(conn, now)
            self._recovered(conn, now)
        if ledger is not None:
            self.ledger.advance(ledger)  # (read up to there: committed)
        self.retention.tick(self.db)  # a bounded slice, in write transactions of its own
        return rep

    def _ledger(self, conn: Connection, now: float) -> LedgerTick | None:
        """The health ledger's share (``control.ledger``), in a savepoint of its own: a
        failure there is logged and read again on the next tick, and never takes a run's
        fault handling down with it."""
        try:
            with conn.begin_nested():
                return self.ledger.tick(conn, now)
        except Exception:
            log.exception("health ledger: reading the evidence failed (read again next tick)")
            return None

    def _revoke_ended(self, conn: Connection, now: float) -> None:
        """A run that ended writes nothing more: once its agents had the node-lost deadline
        to take their last commands (a stop's) and report, and none of them is still
        leaving (heard from, its stop not finished: it delivers what it spooled first),
        their credentials are revoked (an agent still sending is refused, registers again,
        and is told the run ended)."""
        grace = self.detection.node_lost.deadline_s
        for run_id in credentials.ended_runs_holding_credentials(
                conn, ended_before=now - grace):
            with self._contained(conn, run_id, JudgeStage.UPKEEP, now):
                revoked = credentials.revoke_run(conn, run_id=run_id, now=now)
                self._supervisor_event(
                    conn, run_id, SupervisorEvent.CREDENTIALS_REVOKED, now,
                    f"the run has ended: the credentials of its {len(revoked)} agent(s) are "
                    "revoked", {"agents": revoked})
                if self.on_revoked is not None:
                    self.on_revoked(revoked)

    def _recovered(self, conn: Connection, now: float) -> None:
        """Runs whose failing episode ended this tick: an event says so."""
        for run_id in [r for r in self._failing if r not in self._failed_this_tick]:
            since = self._failing.pop(run_id)
            self._supervisor_event(
                conn, run_id, SupervisorEvent.JUDGE_RECOVERED, now,
                f"the supervisor judges this run again (it failed for {now - since:.1f} s)",
                {"failed_since": since})

    def _judge_overload(self, now: float) -> tuple[bool, float | None]:
        """This tick's overload verdict (``OverloadWatch.judge``).  While overloaded, the hang,
        node-lost and straggler verdicts are held back (``_observe_active``); once it ends
        they are judged from then on, as after a supervisor restart."""
        started, ended = self.overload_watch.judge(now)
        if ended is not None:
            self.observing_since = max(self.observing_since, now)
        return started, ended

    def observe_from_now(self) -> None:
        """Judge hangs and lost nodes from now on (a replica that has just become the
        leader: the time no evaluator ran is no run's fault, nor an overload of this one)."""
        self.observing_since = self.clock()
        self.overload_watch.forget_gap()

    def overload_state(self) -> tuple[bool, float | None]:
        """(overloaded at the last tick, batch lateness now): what /metrics exports."""
        return self.overload_watch.state(self.clock())

    def _record_overload(self, conn: Connection, now: float, ended: float | None) -> None:
        """One event per active run when an overload starts and when it ends."""
        for run in registry.active_runs(conn):
            decision = policy.on_overload(
                reason=self.overload.reason if self.overload is not None else None,
                lateness_s=self.overload.lateness_s if self.overload is not None else None,
                ended_after_s=ended)
            actions.apply(conn, run=run, decision=decision, now=now)

    def _presence(self, conn: Connection, run: RunRow, now: float) -> None:
        """Record when no agent of the run runs any more (``agents_down``: silent for the
        node-lost deadline) and, without a registration to end it, when one is heard from
        again (``agents_up``).  Not while overloaded: late batches are not absent agents."""
        g = self.goodput_feed.live(int(run["id"]))
        if g is None or self.overload is not None:
            return
        beat = self.goodput_feed.newest_heartbeat.get(int(run["id"]))
        if g.down_since is None:
            lost = lost_deadline(self.detection, self.advised_batch_interval())
            if beat is not None and agents_gone(beat, now, lost,
                                                observing_since=self.observing_since):
                actions.apply(conn, run=run, now=now, decision=policy.on_agents_gone(
                    since=beat, deadline_s=lost.deadline_s))
        elif beat is not None and beat > g.down_since:
            actions.apply(conn, run=run, now=now, decision=policy.on_agents_back(at=beat))

    def _observe_active(self, now: float) -> dict[int, Observation]:
        """Feed the goodput accounting, then have the observer run the detectors on every
        active run (reads only); the state of runs that are no longer active goes."""
        with self.db.read() as conn:
            active = registry.active_runs(conn)
            for gone in self._runs.keys() - {int(r["id"]) for r in active}:
                self._runs.pop(gone)
                self.goodput_feed.end(conn, gone)
            for run in active:
                self._state(run)
                try:
                    self.goodput_feed.update(conn, run, now=now)
                except Exception:  # the accounting must never stop the fault handling
                    log.exception("run %s: goodput accounting failed; it starts over",
                                  run["name"])
                    self.goodput_feed.start_over(int(run["id"]))
        req = ObserveRequest(now=now, observing_since=self.observing_since,
                             held=self.overload is not None,  # (_judge_overload)
                             batch_interval_s=self.advised_batch_interval())
        return self.observer.observe(self.db, req, keepalive=self.keepalive) or {}

    def goodput_series(self, run_id: int, window_s: float) -> dict[str, Any] | None:
        """``LiveGoodput.series`` now (``GoodputFeed.series``)."""
        return self.goodput_feed.series(run_id, self.clock(), window_s)

    def goodput(self, run_id: int) -> dict[str, Any] | None:
        """The run's live ETTR and badput by cause now (``GoodputFeed.snapshot``)."""
        return self.goodput_feed.snapshot(run_id, self.clock())

    def _protect(self, conn: Connection, run: RunRow) -> None:
        """Publish what the workers' retention must keep (every ingest reply carries it)."""
        facts = policy.ProtectFacts(
            checkpoints=tuple(rec.lineage_checkpoints(conn, run_id=run["id"])),
            open_incidents=tuple(
                (i["kind"], i["step"], float(i["opened_at"]))
                for i in rec.incidents_of(conn, run_id=run["id"],
                                          status=IncidentStatus.OPEN)),
            pending_targets=tuple(
                str((a["plan"] or {})["checkpoint"]) for a in rec.actions_in_progress(conn)
                if a["run_id"] == run["id"] and a["kind"] == ActionKind.RESTART
                and isinstance((a["plan"] or {}).get("checkpoint"), str)),
        )
        paths = policy.protected_checkpoints(facts, self.cfg)
        if paths != list(run.get("protected") or []):
            registry.set_protected(conn, run_id=run["id"], paths=paths)

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Tick until ``stop`` is set; an error in one tick is logged, the loop goes on."""
        try:
            while not stop.wait(interval_s):
                try:
                    self.tick()
                except Exception:
                    log.exception("evaluator tick failed")
        finally:
            self.observer.close()

    def start(self, interval_s: float) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        th = threading.Thread(target=self.run, args=(stop, interval_s),
                              name="trainwarden-evaluator", daemon=True)
        th.start()
        return th, stop

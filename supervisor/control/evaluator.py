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

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from trainwarden.agent import protocol
from trainwarden.agent.core import text as untrusted
from trainwarden.agent.core.bounds import bounded, check
from trainwarden.agent.core.findings import FindingKind, Severity
from trainwarden.agent.core.states import LIVE_AGENT_STATES, NodeRole
from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.control import actions, membership, policy
from trainwarden.supervisor.control.detection import DetectionConfig, lost_deadline
from trainwarden.supervisor.control.goodput_feed import GoodputFeed
from trainwarden.supervisor.control.ledger import HealthLedger, LedgerTick
from trainwarden.supervisor.control.observer import (
    Observation,
    Observer,
    ObserveRequest,
    ObserverProcess,
)
from trainwarden.supervisor.control.overload import OverloadWatch
from trainwarden.supervisor.control.retention import Retention, RetentionConfig
from trainwarden.supervisor.detect import Finding
from trainwarden.supervisor.detect.node_health import CordonConfig
from trainwarden.supervisor.detect.node_lost import agents_gone, silent_members
from trainwarden.supervisor.detect.overload import Overload
from trainwarden.supervisor.detect.stacks import hang_culprit
from trainwarden.supervisor.enums import (
    IN_PROGRESS,
    ActionKind,
    ActionStatus,
    IncidentKind,
    IncidentStatus,
    JudgeStage,
    RunStatus,
    SupervisorEvent,
    Verdict,
)
from trainwarden.supervisor.ingest.delivery import DeliveryMonitor
from trainwarden.supervisor.store import credentials, registry, windows
from trainwarden.supervisor.store import membership as store_membership
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection, Database
from trainwarden.supervisor.store.rows import ExitRow, IncidentRow, NodeEventRow, RunRow

log = logging.getLogger("trainwarden.evaluator")



# Worker events that end an attempt, with the incident kind they open.  A "distributed_error"
# (connection reset by a peer, ...) is left out on purpose: it is what the survivors see when
# a peer dies, and the agent's exit report that follows names the rank that really failed.
_FAILURE_EVENTS: dict[str, IncidentKind] = {
    protocol.WorkerEventName.COLLECTIVE_TIMEOUT: IncidentKind.COLLECTIVE_TIMEOUT,
    protocol.WorkerEventName.REPLICA_MISMATCH: IncidentKind.SDC}
_STACKS_EVENT = protocol.AgentEventName.STACKS
# Event findings whose detector already reports each episode once (from the store's events).
_EPISODE_EVENTS = frozenset({FindingKind.DISK_LOW, FindingKind.DISK_RECOVERED})


@dataclass
class TickReport:
    exits: int = 0
    decisions: int = 0
    advanced: int = 0
    findings: int = 0


@dataclass(frozen=True)
class EvaluatorConfig:
    SECTION: ClassVar[str] = "evaluator"

    interval_s: float = bounded(0.5, gt=0)  # seconds between two ticks of the evaluation loop
    # where the detectors run: "process" (a child process of their own, so their CPU never
    # competes with ingest) or "thread" (the evaluator's own, in the supervisor's process)
    observer: Literal["process", "thread"] = bounded("process", one_of=("process", "thread"))

    def __post_init__(self) -> None:
        check(self)


@dataclass
class RunState:
    """What the evaluator keeps about one active run between ticks; it goes when the run
    stops being active (completed, failed, stopped)."""

    # agent id -> (the other attempt it reports, since when): see ``_attempt_mismatches``
    mismatch: dict[int, tuple[int, float]] = field(default_factory=dict)


class Evaluator:
    def __init__(self, db: Database, cfg: policy.PolicyConfig, *, clock: Clock = time.time,
                 detection: DetectionConfig | None = None,
                 delivery: DeliveryMonitor | None = None,
                 retention: RetentionConfig | None = None,
                 cordon: CordonConfig | None = None) -> None:
        self.db = db
        self.cfg = cfg
        self.clock = clock
        self.detection = detection or DetectionConfig()
        self.overload_watch = OverloadWatch(self.detection.overload, delivery)
        # the detectors, in this thread; the app puts them in a process of their own
        self.observer: Observer | ObserverProcess = Observer(self.detection)
        # Called while the tick waits on the observer process (a leader renews its lease).
        self.keepalive: Callable[[], object] | None = None
        self.retention = Retention(retention, self.detection)  # old per-rank rows rolled up
        self.ledger = HealthLedger(cordon)  # evidence against nodes, and the cordons
        # Hangs and lost nodes are judged on what this process could observe: a supervisor
        # that was down must not call a hang on data it could not receive.
        self.observing_since = clock()
        self._event_cursor = 0  # worker events are read once, in id order
        self._unattached: list[NodeEventRow] = []  # stack dumps that came before their incident
        self._runs: dict[int, RunState] = {}  # run id -> its state (active runs only)
        # The goodput of runs that ended while this process watched them (newest kept).
        self.goodput_feed = GoodputFeed()
        # Runs the tick failed to judge: run id -> how many times (``/metrics``), and the
        # runs failing now -> since when (one event per episode).
        self.run_failures: dict[int, int] = {}
        self._failing: dict[int, float] = {}
        self._failed_this_tick: set[int] = set()
        self._retry_events: list[NodeEventRow] = []  # failure events a failed tick left
        # Exits held while a peer's death may still be confirmed: exit id -> first seen.
        self._held_exits: dict[int, float] = {}
        # Told the agents whose credentials the tick revoked (the app's credential cache).
        self.on_revoked: Callable[[list[int]], object] | None = None

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

    # -- one run's failure stays that run's ----------------------------------------------------

    @contextlib.contextmanager
    def _contained(self, conn: Connection, run_id: int, stage: JudgeStage, now: float
                   ) -> Iterator[None]:
        """Run one run's share of the tick in a savepoint of its own: an error there (a row
        the store refuses, a bug met by one run's data) is rolled back to the savepoint,
        recorded against that run (``_judge_failed``) and retried on the next tick, while
        every other run is judged on this one."""
        try:
            with conn.begin_nested():
                yield
        except Exception as e:
            self._judge_failed(conn, run_id, stage, e, now)

    def _judge_failed(self, conn: Connection, run_id: int, stage: JudgeStage, error: Exception,
                      now: float) -> None:
        self._failed_this_tick.add(run_id)
        self.run_failures[run_id] = self.run_failures.get(run_id, 0) + 1
        if run_id in self._failing:  # (logged and recorded once per episode)
            return
        self._failing[run_id] = now
        log.exception("run %s: judging it failed at %s (retried next tick; other runs are "
                      "judged as usual)", run_id, stage)
        what = untrusted.clean(f"{type(error).__name__}: {error}", 2000)
        self._supervisor_event(
            conn, run_id, SupervisorEvent.JUDGE_FAILED, now,
            f"the supervisor failed to judge this run ({stage}): {what}; it retries on every "
            "tick, and other runs are judged as usual", {"stage": str(stage), "error": what})

    def _recovered(self, conn: Connection, now: float) -> None:
        """Runs whose failing episode ended this tick: an event says so."""
        for run_id in [r for r in self._failing if r not in self._failed_this_tick]:
            since = self._failing.pop(run_id)
            self._supervisor_event(
                conn, run_id, SupervisorEvent.JUDGE_RECOVERED, now,
                f"the supervisor judges this run again (it failed for {now - since:.1f} s)",
                {"failed_since": since})

    def _supervisor_event(self, conn: Connection, run_id: int, name: SupervisorEvent,
                          now: float, message: str, details: dict[str, Any]) -> None:
        """One event about the supervisor's own handling of a run, in a savepoint of its own
        (recording it must not take the rest of the tick down with it)."""
        try:
            with conn.begin_nested():
                attempt = registry.get_run(conn, run_id=run_id)["attempt"]
                rec.insert_event(conn, run_id=run_id, agent_id=None, attempt=attempt,
                                 rank=None, t=now, name=name, step=None, message=message,
                                 details=details)
        except Exception:
            log.exception("run %s: recording the %s event failed", run_id, name)

    # -- overload ----------------------------------------------------------------------------

    def _judge_overload(self, now: float) -> tuple[bool, float | None]:
        """This tick's overload verdict (``OverloadWatch.judge``).  While overloaded, the hang,
        node-lost and straggler verdicts are held back (``_observe_active``); once it ends
        they are judged from then on, as after a supervisor restart."""
        started, ended = self.overload_watch.judge(now)
        if ended is not None:
            self.observing_since = max(self.observing_since, now)
        return started, ended

    @property
    def overload(self) -> Overload | None:
        """The last tick's verdict: the supervisor is behind (None: it keeps up)."""
        return self.overload_watch.verdict

    def observe_from_now(self) -> None:
        """Judge hangs and lost nodes from now on (a replica that has just become the
        leader: the time no evaluator ran is no run's fault, nor an overload of this one)."""
        self.observing_since = self.clock()
        self.overload_watch.forget_gap()

    def advised_batch_interval(self) -> float | None:
        """What the ingest reply asks agents to batch at (``policy.advised_batch_interval``,
        decided at the last tick: ingest reads it for every batch)."""
        return self.overload_watch.advice

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

    # -- presence (the goodput's idle time) ---------------------------------------------------

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

    # -- membership --------------------------------------------------------------------------

    def _live_s(self) -> float:
        """A node heard from within this long is live (the node-lost deadline, at the batch
        interval the agents were asked for)."""
        return lost_deadline(self.detection, self.advised_batch_interval()).deadline_s

    def _fill_missing(self, conn: Connection, run: RunRow, now: float,
                      rep: TickReport) -> None:
        """A run whose attempt stands by for a missing node restarts as soon as a node can
        take that rank (a spare registered, the lost node came back)."""
        ranks, waiting = actions.waiting_for(conn, run)
        if not ranks:
            return
        plan, _, _ = actions.plan_members(conn, run_id=int(run["id"]), now=now,
                                          live_s=self._live_s())
        if len(plan.waiting) >= len(ranks):
            return
        joined = [r.new for r in plan.replaced] or sorted(
            set(plan.members.values()) & waiting)
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
        decision = policy.on_node_joined(actions.facts(run), joined=joined,
                                         checkpoint=ckpt["path"] if ckpt else None, now=now)
        rep.decisions += 1
        log.info("run %s: %s", run["name"], decision)
        actions.apply(conn, run=run, decision=decision, now=now, live_s=self._live_s())

    def _grow_back(self, conn: Connection, run: RunRow, busy: bool, now: float,
                   rep: TickReport) -> None:
        """A shrunk run with a node free again (a spare registered, the lost node came back)
        grows back to its declared world at its next checkpoint: first the plan is recorded
        (``grow_planned``, with the highest step trained so far), then the first complete
        checkpoint of a later step restarts the gang from it on every node."""
        if run["status"] != RunStatus.RUNNING or busy:
            return
        m = store_membership.run_membership(conn, run_id=int(run["id"]))
        world, declared = m["world"], m["nnodes"]
        if world is None or declared is None or world >= declared:
            return
        plan, _, _ = actions.plan_members(conn, run_id=int(run["id"]), now=now,
                                          live_s=self._live_s(), grow=True)
        if plan.nnodes is None or plan.nnodes <= world:
            return
        joined = [r.new for r in plan.replaced]
        ev = windows.latest_event(conn, run_id=run["id"], attempt=run["attempt"],
                                  name=SupervisorEvent.GROW_PLANNED)
        details = ev["details"] if ev is not None and isinstance(ev["details"], dict) else {}
        if ev is None or details.get("epoch") != m["epoch"]:
            after = actions.high_step(conn, int(run["id"]))
            rec.insert_event(
                conn, run_id=run["id"], agent_id=None, attempt=int(run["attempt"]), rank=None,
                t=now, name=SupervisorEvent.GROW_PLANNED, step=after,
                message=f"{', '.join(joined)} free: the run grows back from {world} to "
                        f"{plan.nnodes} nodes at its next checkpoint",
                details={"epoch": m["epoch"], "after_step": after, "nodes": joined})
            return
        after = details.get("after_step")
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
        if ckpt is None or (isinstance(after, int) and int(ckpt["step"]) <= after):
            return
        decision = policy.on_grow(actions.facts(run), joined=joined, world=world,
                                  declared=plan.nnodes, checkpoint=ckpt["path"],
                                  step=int(ckpt["step"]), now=now)
        rep.decisions += 1
        log.info("run %s: %s", run["name"], decision)
        actions.apply(conn, run=run, decision=decision, now=now, live_s=self._live_s())

    def _replace_cordoned(self, conn: Connection, run: RunRow, now: float,
                          rep: TickReport) -> None:
        """A restart that has not resumed yet, one of whose members is cordoned now, is
        decided again with the same plan so a free spare takes that rank (no spare: it goes
        on; the next restart stands the rank by).  One cordoned for silent data corruption is
        never kept: the run shrinks without it if it may, else it is stopped."""
        action = rec.restart_action_for(conn, run_id=run["id"], attempt=run["attempt"])
        if action is None or action["status"] not in IN_PROGRESS:
            return
        m = (action["plan"] or {}).get("membership")
        if not isinstance(m, dict):
            return
        reasons = actions.cordon_reasons(conn, run_id=int(run["id"]))
        bad = sorted(set(m.get("members") or {}) & set(reasons))
        if not bad:
            return
        plan, _, _ = actions.plan_members(conn, run_id=int(run["id"]), now=now, live_s=None)
        # A member cordoned for silent data corruption never keeps its rank: with no spare to
        # take it (its rank waits), the run stops rather than rolls back onto it again.
        stuck = {node: reasons[node] for node in (plan.members.get(k) for k in plan.waiting)
                 if node is not None and node in bad and policy.corrupting(reasons[node])}
        # (a shrink that leaves it out is decided again too)
        shrunk = any(d.why == membership.CORRUPTING for d in plan.dropped)
        if not (stuck or plan.replaced or shrunk):
            return
        pending = protocol.ResumePlan.from_dict({k: v for k, v in (action["plan"] or {}).items()
                                        if k != "membership"})
        decision: policy.Restart | policy.Stop = (
            policy.on_corrupting_member(actions.facts(run), cordoned=stuck, pending=pending)
            if stuck else policy.on_member_cordoned(actions.facts(run), cordoned=bad,
                                                    pending=pending, now=now))
        rep.decisions += 1
        log.info("run %s: %s", run["name"], decision)
        actions.apply(conn, run=run, decision=decision, now=now, live_s=None)

    # -- attempt mismatch --------------------------------------------------------------------

    def _attempt_mismatches(self, conn: Connection, run: RunRow, busy: bool, now: float,
                            rep: TickReport) -> None:
        """Agents whose reports carry another attempt than the run's: none of what they
        report counts for the run's attempt, so the policy realigns them within seconds, or
        opens an incident that says why (``policy.on_attempt_mismatch``).  A restart under
        way (an action in progress, a command in flight to the agent) is not a mismatch."""
        state = self._state(run)
        attempt = int(run["attempt"])
        open_incidents = {i["agent_id"]: i for i in rec.incidents_of(
            conn, run_id=run["id"], kinds=[IncidentKind.ATTEMPT_MISMATCH],
            status=IncidentStatus.OPEN)}
        tracked = set()
        off = registry.agents_off_attempt(conn, run_id=run["id"], attempt=attempt)
        off_ids = {ag["id"] for ag in off}
        for aid in [k for k in open_incidents if k is not None and k not in off_ids]:
            rec.resolve_incident(conn, incident_id=open_incidents[aid]["id"], now=now)
        for ag in off:
            aid = ag["id"]
            cmds = rec.agent_commands(conn, agent_id=aid)
            if busy or any(c["action_id"] is not None for c in cmds):
                continue
            reported = ag["attempt"]
            prev = state.mismatch.get(aid)
            if prev is None or prev[0] != reported:
                prev = state.mismatch[aid] = (reported, now)
            tracked.add(aid)
            sent = [c for c in cmds if c["action_id"] is None and c["attempt"] == attempt
                    and float(c["created_at"]) >= prev[1]]
            facts = policy.MismatchFacts(
                agent_id=aid, node=ag["node"], agent_attempt=reported, run_attempt=attempt,
                mismatch_s=now - prev[1], agent_state=ag["state"] or "",
                last_seen_s=now - float(ag["last_seen_at"] or now),
                realign=policy.RealignSent(status=sent[-1]["status"],
                                           age_s=now - float(sent[-1]["created_at"]),
                                           detail=sent[-1]["detail"] or "") if sent else None,
                incident_open=aid in open_incidents)
            decision = policy.on_attempt_mismatch(facts, self.cfg)
            if isinstance(decision, policy.Realign):
                rep.decisions += 1
                log.warning("run %s: %s", run["name"], decision.reason)
                actions.realign(conn, run=run, node=ag["node"], decision=decision, now=now)
            elif isinstance(decision, policy.OpenIncident):
                rep.decisions += 1
                log.error("run %s: %s", run["name"], decision.incident.cause)
                actions.apply(conn, run=run, decision=decision, now=now)
        for gone in state.mismatch.keys() - tracked:
            del state.mismatch[gone]

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

    # -- goodput -----------------------------------------------------------------------------

    def goodput_series(self, run_id: int, window_s: float) -> dict[str, Any] | None:
        """``LiveGoodput.series`` now (``GoodputFeed.series``)."""
        return self.goodput_feed.series(run_id, self.clock(), window_s)

    def goodput(self, run_id: int) -> dict[str, Any] | None:
        """The run's live ETTR and badput by cause now (``GoodputFeed.snapshot``)."""
        return self.goodput_feed.snapshot(run_id, self.clock())

    def _state(self, run: RunRow) -> RunState:
        state = self._runs.get(int(run["id"]))
        if state is None:
            state = self._runs[int(run["id"])] = RunState()
        return state

    # -- exits -------------------------------------------------------------------------------

    def _exits(self, conn: Connection, now: float, rep: TickReport) -> None:
        """Every agent exit report not handled yet, in the order they arrived."""
        for ex in rec.unhandled_exits(conn):
            run_id = int(ex["run_id"])
            if run_id in self._failed_this_tick:
                continue  # a run's exits are judged in order: its later ones wait
            rep.exits += 1
            with self._contained(conn, run_id, JudgeStage.EXITS, now):
                # Fresh run state each time: an earlier exit in this tick may have moved it.
                run = registry.get_run(conn, run_id=run_id)
                decision = self._on_exit(conn, run, ex, now)
                if not isinstance(decision, policy.Note):
                    rep.decisions += 1
                    log.info("run %s: %s", run["name"], decision)
                actions.apply(conn, run=run, decision=decision, now=now,
                              live_s=self._live_s())
                if isinstance(decision, policy.Note) and decision.verdict == Verdict.LATE:
                    self._reattribute(conn, run, ex, now)
                if isinstance(decision, policy.Note) and decision.verdict == Verdict.WAIT:
                    # Held (a survivor's lost connection): judged again on the next tick.  The
                    # run's later exits go on being judged: one of them may be the cause.
                    continue
                self._held_exits.pop(int(ex["id"]), None)
                verdict = decision.verdict if isinstance(decision, policy.Note) else (
                    Verdict.COMPLETED if isinstance(decision, policy.Complete) else Verdict.FAILURE
                )
                rec.mark_exit(conn, exit_id=ex["id"], verdict=verdict)

    @staticmethod
    def _exit_facts(conn: Connection, run: RunRow, ex: ExitRow) -> policy.ExitFacts:
        attempt = int(ex["attempt"])
        return policy.ExitFacts(
            id=ex["id"], agent_id=ex["agent_id"], node=ex["node"], attempt=attempt,
            outcome=ex["outcome"], exit_code=ex["exit_code"], signal=ex["signal"],
            failed_ranks=list(ex["failed_ranks"] or []),
            rank_steps={int(r["rank"]): int(r["step"]) for r in windows.rank_progress(
                conn, run_id=run["id"], attempt=attempt)},
            peer_error_ranks=windows.ranks_with_event(
                conn, run_id=run["id"], attempt=attempt,
                name=protocol.WorkerEventName.DISTRIBUTED_ERROR),
        )

    def _reattribute(self, conn: Connection, run: RunRow, ex: ExitRow, now: float) -> None:
        """A late exit of the attempt a crash incident ended may name the rank at fault
        where the incident named a survivor (``policy.reattribute``)."""
        (inc,) = rec.incidents_of(conn, run_id=run["id"], attempt=int(ex["attempt"]),
                                  kinds=[IncidentKind.CRASH])[:1] or (None,)
        if inc is None:
            return
        spec = policy.reattribute(inc, self._exit_facts(conn, run, ex))
        if spec is None:
            return
        rec.update_incident(conn, incident_id=inc["id"], cause=spec.cause, node=spec.node,
                            rank=spec.rank, agent_id=spec.agent_id, exit_code=spec.exit_code,
                            signal=spec.signal, details={**spec.details,
                                                         "survivor": inc["cause"]},
                            updated_at=now)
        log.info("run %s: incident %s names %s rank %s (it named a survivor)", run["name"],
                 inc["id"], spec.node, spec.rank)

    def _on_exit(self, conn: Connection, run: RunRow, ex: ExitRow, now: float
                 ) -> policy.Decision:
        """The policy's decision on one exit, given the run's state in the store."""
        members = [a for a in registry.run_agents(conn, run_id=run["id"])
                   if a["role"] == NodeRole.MEMBER]  # a spare runs nothing
        agent_ids = frozenset(a["id"] for a in members)
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
        pending = rec.restart_action_for(conn, run_id=run["id"], attempt=run["attempt"])
        restart_pending = pending is not None and pending["status"] in (
            ActionStatus.QUEUED, ActionStatus.DELIVERED) and ex["attempt"] == run["attempt"] - 1
        attempt = int(ex["attempt"])
        facts = self._exit_facts(conn, run, ex)
        completed = rec.completed_agents(
            conn, run_id=run["id"], attempt=attempt if restart_pending else run["attempt"])
        lost = lost_deadline(self.detection, self.advised_batch_interval())
        silent = silent_members(
            {a["node"]: float(a["last_seen_at"] or 0.0) for a in members
             if a["id"] != ex["agent_id"] and a["state"] in LIVE_AGENT_STATES},
            now, lost, observing_since=self.observing_since) if attempt == run["attempt"] else {}
        first = self._held_exits.setdefault(int(ex["id"]), now)
        host = store_membership.run_membership(conn, run_id=run["id"])["members"].get(0)
        return policy.on_exit(
            actions.facts(run), facts, agent_ids=agent_ids,
            completed_agent_ids=frozenset(completed), restart_pending=restart_pending,
            recovery=actions.recovery(conn, run), checkpoint=ckpt["path"] if ckpt else None,
            cfg=self.cfg, now=now, silent_peers=silent,
            may_wait=now - first < lost.confirm_wait_s,
            rendezvous=policy.RendezvousFacts(host=host["node"] if host else None))

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

    # -- detection ---------------------------------------------------------------------------

    def _worker_events(self, conn: Connection, now: float, rep: TickReport) -> None:
        """Distributed failures reported by workers end their attempt; stack dumps are
        attached to the incident they were taken for."""
        names = [*_FAILURE_EVENTS, _STACKS_EVENT]
        retry, self._unattached = self._unattached, []
        for ev in retry:
            if now - float(ev["t"]) < 300:  # an incident that never comes: give up in time
                self._attach_stacks(conn, registry.get_run(conn, run_id=ev["run_id"]), ev, now)
        failed, self._retry_events = self._retry_events, []
        fresh = windows.events_after(conn, after_id=self._event_cursor, names=names)
        for ev in [*(e for e in failed if now - float(e["t"]) < 300), *fresh]:
            self._event_cursor = max(self._event_cursor, int(ev["id"]))
            run_id = int(ev["run_id"])
            if run_id in self._failed_this_tick:
                self._retry_events.append(ev)  # in order, after the one that failed
                continue
            with self._contained(conn, run_id, JudgeStage.EVENTS, now):
                self._worker_event(conn, ev, now, rep)
            if run_id in self._failed_this_tick:
                self._retry_events.append(ev)

    def _worker_event(self, conn: Connection, ev: NodeEventRow, now: float,
                      rep: TickReport) -> None:
        run = registry.get_run(conn, run_id=ev["run_id"])
        if ev["name"] == _STACKS_EVENT:
            if ev.get("member", True):  # (a non-member's stacks name no culprit)
                self._attach_stacks(conn, run, ev, now)
            return
        details = dict(ev.get("details") or {})
        if ev["name"] == protocol.WorkerEventName.REPLICA_MISMATCH:
            self._replica_mismatch(conn, run, ev, details, now, rep)
            return
        collective = details.get("collective", "unknown")
        rank = ev["rank"]
        if ev["step"] is None and rank is not None:
            # The step it was stuck in: the one after the last its rank reported.
            last = {int(r["rank"]): int(r["step"]) for r in windows.rank_progress(
                conn, run_id=run["id"], attempt=int(ev["attempt"]))}.get(rank)
            ev = {**ev, "step": None if last is None else last + 1}
        where = f"rank {ev['rank']}" + (f" on node {ev['node']}" if ev.get("node") else "")
        finding = policy.FindingFacts(
            kind=_FAILURE_EVENTS[ev["name"]], severity=Severity.INCIDENT,
            message=f"{ev['name'].replace('_', ' ')} in {collective} on {where}: "
                    f"{ev['message']}",
            attempt=int(ev["attempt"]), step=ev.get("step"), rank=ev.get("rank"),
            node=ev.get("node"), details={"collective": collective, "event_id": ev["id"],
                                          **details},
            member=bool(ev.get("member", True)))
        rep.findings += 1
        self._decide(conn, run, finding, now, rep)

    def _replica_mismatch(self, conn: Connection, run: RunRow, ev: NodeEventRow,
                          details: dict[str, Any], now: float, rep: TickReport) -> None:
        """Silent data corruption: the incident names the minority's rank and the node it
        ran on (the event comes from a rank of the majority, on whatever node)."""
        corrupt = [r for r in details.get("corrupt") or [] if isinstance(r, int)]
        rank = corrupt[0] if len(corrupt) == 1 else None
        nodes = windows.rank_nodes(conn, run_id=run["id"])
        node = nodes.get(rank) if rank is not None else None
        details["nodes"] = {str(r): nodes.get(r) for r in corrupt or details.get("suspects") or []
                            if isinstance(r, int)}
        step = details.get("first_disagreement", ev.get("step"))
        finding = policy.FindingFacts(
            kind=IncidentKind.SDC, severity=Severity.INCIDENT,
            message=policy.sdc_message(details, node), attempt=int(ev["attempt"]),
            step=step if isinstance(step, int) else None, rank=rank, node=node,
            # (who made the claim: the evidence it holds against another node counts for the
            # host only when that agent is trusted for its own: control.ledger)
            details={"event_id": ev["id"], **details, "reported_by": ev.get("node")},
            member=bool(ev.get("member", True)))
        rep.findings += 1
        self._decide(conn, run, finding, now, rep)

    def _attach_stacks(self, conn: Connection, run: RunRow, ev: NodeEventRow, now: float) -> None:
        details = ev.get("details") or {}
        incident_id = None
        if isinstance(details.get("command_id"), int):
            incident_id = rec.incident_for_command(conn, command_id=details["command_id"])
        if incident_id is None:  # the agent's own watchdog: the hang of that attempt
            hangs = rec.incidents_of(conn, run_id=run["id"], attempt=ev["attempt"],
                                      kinds=[IncidentKind.HANG])
            incident_id = hangs[-1]["id"] if hangs else None
        if incident_id is None:
            self._unattached.append(ev)  # the exit that opens the hang incident may follow
            return
        inc = rec.get_incident(conn, incident_id=incident_id)
        assert inc is not None
        before = inc["details"] or {}
        merged = {**before,
                  "stacks": {**(before.get("stacks") or {}), **(details.get("stacks") or {})},
                  "stacks_node": ev.get("node"),
                  "stacks_nodes": sorted({*(before.get("stacks_nodes") or []),
                                          *([ev["node"]] if ev.get("node") else [])})}
        values = _name_culprit(inc, merged, windows.rank_nodes(conn, run_id=run["id"]))
        rec.update_incident(conn, incident_id=incident_id, updated_at=now, **values)

    def _act_on(self, conn: Connection, run: RunRow, obs: Observation, now: float,
                rep: TickReport) -> None:
        """Hand one run's findings to the policy and apply its decisions."""
        if obs.stragglers is not None:
            self._resolve_ended_stragglers(conn, run, obs.stragglers, now)
        for f in obs.findings:
            if f.kind == FindingKind.RANK_STALLED:
                continue  # its hang (if it is one) is judged by the hang finding
            rep.findings += 1
            facts = policy.FindingFacts(
                kind=f.kind, severity=f.severity, message=f.message,
                attempt=obs.attempt, step=f.step, rank=f.rank, node=f.node,
                details=_jsonable(f.details), started_at=f.started_at)
            self._decide(conn, run, facts, now, rep)
            run = registry.get_run(conn, run_id=run["id"])  # a decision may have moved it

    def _resolve_ended_stragglers(self, conn: Connection, run: RunRow,
                                  slow: dict[int | None, Finding], now: float) -> None:
        """One episode, one incident: while its rank is flagged the incident is updated;
        it is resolved once the rank has not been flagged for a whole hold window (a score
        near the threshold flickers, and that must not open and close incidents)."""
        span = windows.step_range(conn, run_id=run["id"], attempt=run["attempt"])
        newest = span[1] if span else None
        hold = max(self.detection.straggler.hold_steps, self.detection.straggler.window_steps)
        for inc in rec.incidents_of(conn, run_id=run["id"], kinds=[IncidentKind.STRAGGLER],
                                     status=IncidentStatus.OPEN):
            details = dict(inc["details"] or {})
            f = slow.get(inc["rank"])
            if f is not None:
                fresh = {**details, "last_flagged_step": newest,
                         "score": f.details.get("score")}
                if fresh != details:  # touch the row only when the episode moved on
                    rec.update_incident(conn, incident_id=inc["id"], details=fresh,
                                         updated_at=now)
                continue
            last = details.get("last_flagged_step", details.get("flagged_at_step"))
            if inc["attempt"] != run["attempt"] or newest is None or last is None \
                    or newest - int(last) >= hold:
                rec.resolve_incident(conn, incident_id=inc["id"], now=now)

    def _decide(self, conn: Connection, run: RunRow, finding: policy.FindingFacts, now: float,
                rep: TickReport) -> None:
        this_attempt = rec.incidents_of(conn, run_id=run["id"], attempt=run["attempt"])
        open_watch = frozenset(
            (i["kind"], i["rank"] if i["kind"] == IncidentKind.STRAGGLER else None)
            for i in rec.incidents_of(conn, run_id=run["id"], status=IncidentStatus.OPEN)
            if i["kind"] in policy.WATCH_KINDS)
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
        decision = policy.on_finding(
            actions.facts(run), finding,
            incident_kinds_this_attempt=frozenset(i["kind"] for i in this_attempt),
            open_watch=open_watch, checkpoint=ckpt["path"] if ckpt else None,
            cfg=self.cfg, now=now,
            recovery=actions.recovery(conn, run, _named_steps(finding)),
            waiting_for=frozenset(actions.waiting_for(conn, run)[1]))
        if isinstance(decision, policy.Note):
            return
        if not isinstance(decision, policy.RecordEvent):
            rep.decisions += 1
            log.info("run %s: %s", run["name"], decision)
        elif decision.name not in _EPISODE_EVENTS and _seen_event(conn, run, decision):
            return
        actions.apply(conn, run=run, decision=decision, now=now, live_s=self._live_s())

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


def _name_culprit(inc: IncidentRow, details: dict[str, Any], rank_nodes: dict[int, str]
                  ) -> dict[str, Any]:
    """The incident's new values once (more) stacks are in: the culprit analysis in its
    details, the culprit's rank and node where the hang detector named none (no rank was
    behind), and its cause followed by the verdict, which says why when nobody is named."""
    stacks = {int(k): str(v) for k, v in (details.get("stacks") or {}).items()
              if str(k).isdigit()}
    culprit = hang_culprit(stacks, rank_nodes, details.get("stacks_nodes") or [])
    base = details.setdefault("cause_before_stacks", inc["cause"])
    details["culprit"] = culprit.as_details()
    values: dict[str, Any] = {"details": details, "cause": f"{base}; {culprit.reason}"}
    if culprit.ranks and (inc["rank"] is None or details.get("rank_from") == "stacks"):
        details["rank_from"] = "stacks"
        values["rank"] = culprit.ranks[0]
        values["node"] = rank_nodes.get(culprit.ranks[0])
    return values


def _named_steps(f: policy.FindingFacts) -> list[int]:
    """The steps whose batch index a decision on ``f`` may name: its step, the start of a
    spike before it (a loss that climbed to NaN) and where it was detected (a rollback skips
    from the start through the detection)."""
    steps = [f.step, f.details.get("start_step"), f.details.get("detected_at_step")]
    return sorted({s for s in steps if isinstance(s, int) and not isinstance(s, bool)})


def _seen_event(conn: Connection, run: RunRow, d: policy.RecordEvent) -> bool:
    """An event finding is recorded once per episode (same name and start step)."""
    prev = windows.latest_event(conn, run_id=run["id"], attempt=run["attempt"], name=d.name)
    return prev is not None and prev.get("step") == d.step


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """Finding details as JSON the store accepts (no NaN/Inf, no tuples)."""
    import json
    import math

    def clean(x: object) -> object:
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    out = clean(d)
    json.dumps(out)
    assert isinstance(out, dict)
    return out

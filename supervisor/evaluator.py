"""The evaluation loop: ``tick()`` reads the store, asks the policy, writes actions.

``tick`` observes first, in a read transaction: the detectors' windows (per-rank timings of
the newest steps, losses, progress) are the expensive part, thousands of rows for a big run,
and reading them inside the write transaction held the store's one writer (and with it every
agent's ingest) for the whole tick.  Then one short write transaction applies what the policy
makes of the exits, worker events and findings.  A finding observed for an attempt the run
has left by then is dropped (the next tick observes the new one).  ``run`` is a thin loop
around ``tick`` (a daemon thread started by the app); the clock is injected so tests drive
exactly one tick at a chosen time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Connection

from supervisor import actions, observe, policy
from supervisor.detect import Finding
from supervisor.detect.disk import DISK_LOW, DISK_RECOVERED
from supervisor.store import repo
from supervisor.store.db import Database

log = logging.getLogger("trainwarden.evaluator")

Clock = Callable[[], float]


# Worker events that end an attempt, with the incident kind they open.  A "distributed_error"
# (connection reset by a peer, ...) is left out on purpose: it is what the survivors see when
# a peer dies, and the agent's exit report that follows names the rank that really failed.
_FAILURE_EVENTS = {"collective_timeout": "collective_timeout"}
_STACKS_EVENT = "stacks"
# Event findings whose detector already reports each episode once (from the store's events).
_EPISODE_EVENTS = frozenset({DISK_LOW, DISK_RECOVERED})


@dataclass
class Observation:
    """What the detectors found for one run's attempt (read outside the write lock)."""

    attempt: int
    findings: list[Finding]
    stragglers: dict[int | None, Finding] | None  # None: not looked at this tick


@dataclass
class TickReport:
    exits: int = 0
    decisions: int = 0
    advanced: int = 0
    findings: int = 0


class Evaluator:
    def __init__(self, db: Database, cfg: policy.PolicyConfig, *, clock: Clock = time.time,
                 detection: observe.DetectionConfig | None = None) -> None:
        self.db = db
        self.cfg = cfg
        self.clock = clock
        self.detection = detection or observe.DetectionConfig()
        # Hangs and lost nodes are judged on what this process could observe: a supervisor
        # that was down must not call a hang on data it could not receive.
        self.observing_since = clock()
        self._event_cursor = 0  # worker events are read once, in id order
        self._unattached: list[dict] = []  # stack dumps that arrived before their incident
        # run id -> when its stragglers were last judged, and how long that took
        self._straggler_at: dict[int, tuple[float, float]] = {}
        self._phase_windows: dict[int, observe.PhaseWindow] = {}  # run id -> its window
        self._loss_seen: dict[int, tuple[int, int]] = {}  # run id -> (attempt, newest step)

    def tick(self) -> TickReport:
        now = self.clock()
        rep = TickReport()
        with self.db.read() as conn:
            active = repo.active_runs(conn)
            observed = {int(run["id"]): obs for run in active
                        if (obs := self._observe(conn, run, now)) is not None}
        live = {int(r["id"]) for r in active}
        for gone in self._phase_windows.keys() - live:
            del self._phase_windows[gone]  # the run ended: its window goes with it
        for gone in self._loss_seen.keys() - live:
            del self._loss_seen[gone]
        for gone in self._straggler_at.keys() - live:
            del self._straggler_at[gone]
        with self.db.write() as conn:
            for ex in repo.unhandled_exits(conn):
                rep.exits += 1
                # Fresh run state each time: an earlier exit in this tick may have moved it.
                run = repo.get_run(conn, run_id=ex["run_id"])
                agent_ids = frozenset(a["id"] for a in repo.run_agents(conn, run_id=run["id"]))
                ckpt = repo.newest_complete_checkpoint(conn, run_id=run["id"])
                pending = repo.restart_action_for(conn, run_id=run["id"],
                                                  attempt=run["attempt"])
                restart_pending = pending is not None and pending["status"] in (
                    "queued", "delivered") and ex["attempt"] == run["attempt"] - 1
                decision = policy.on_exit(
                    actions.facts(run),
                    policy.ExitFacts(
                        id=ex["id"], agent_id=ex["agent_id"], node=ex["node"],
                        attempt=ex["attempt"], outcome=ex["outcome"],
                        exit_code=ex["exit_code"], signal=ex["signal"],
                        failed_ranks=list(ex["failed_ranks"] or []),
                        rank_steps={int(r["rank"]): int(r["step"]) for r in repo.rank_progress(
                            conn, run_id=run["id"], attempt=int(ex["attempt"]))},
                        peer_error_ranks=repo.ranks_with_event(
                            conn, run_id=run["id"], attempt=int(ex["attempt"]),
                            name="distributed_error"),
                    ),
                    agent_ids=agent_ids,
                    completed_agent_ids=frozenset(
                        repo.completed_agents(conn, run_id=run["id"],
                                              attempt=ex["attempt"] if restart_pending
                                              else run["attempt"])
                    ),
                    restart_pending=restart_pending,
                    recovery=actions.recovery(conn, run),
                    checkpoint=ckpt["path"] if ckpt else None,
                    cfg=self.cfg,
                    now=now,
                )
                if not isinstance(decision, policy.Note):
                    rep.decisions += 1
                    log.info("run %s: %s", run["name"], decision)
                actions.apply(conn, run=run, decision=decision, now=now)
                verdict = decision.verdict if isinstance(decision, policy.Note) else (
                    "completed" if isinstance(decision, policy.Complete) else "failure"
                )
                repo.mark_exit(conn, exit_id=ex["id"], verdict=verdict)
            for action in repo.actions_in_progress(conn):
                if actions.advance(conn, action=action, now=now) != action["status"]:
                    rep.advanced += 1
            self._worker_events(conn, now, rep)
            for run in repo.active_runs(conn):
                obs = observed.get(int(run["id"]))
                if obs is not None and obs.attempt == int(run["attempt"]):
                    self._act_on(conn, run, obs, now, rep)
            for run in repo.active_runs(conn):
                repo.abandon_branches(conn, run_id=run["id"])  # late checkpoints of old ones
                self._protect(conn, run)
        return rep

    def _protect(self, conn: Connection, run: dict) -> None:
        """Publish what the workers' retention must keep (every ingest reply carries it)."""
        facts = policy.ProtectFacts(
            checkpoints=tuple(repo.lineage_checkpoint_times(conn, run_id=run["id"])),
            open_incidents=tuple(
                (i["kind"], i["step"], float(i["opened_at"]))
                for i in repo.incidents_of(conn, run_id=run["id"], status="open")),
            pending_targets=tuple(
                str(a["plan"]["checkpoint"]) for a in repo.actions_in_progress(conn)
                if a["run_id"] == run["id"] and a["kind"] == "restart"
                and isinstance((a.get("plan") or {}).get("checkpoint"), str)),
        )
        paths = policy.protected_checkpoints(facts, self.cfg)
        if paths != list(run.get("protected") or []):
            repo.set_protected(conn, run_id=run["id"], paths=paths)

    # -- detection ---------------------------------------------------------------------------

    def _worker_events(self, conn: Connection, now: float, rep: TickReport) -> None:
        """Distributed failures reported by workers end their attempt; stack dumps are
        attached to the incident they were taken for."""
        names = [*_FAILURE_EVENTS, _STACKS_EVENT]
        retry, self._unattached = self._unattached, []
        for ev in retry:
            if now - float(ev["t"]) < 300:  # an incident that never comes: give up in time
                self._attach_stacks(conn, repo.get_run(conn, run_id=ev["run_id"]), ev, now)
        for ev in repo.events_after(conn, after_id=self._event_cursor, names=names):
            self._event_cursor = max(self._event_cursor, int(ev["id"]))
            run = repo.get_run(conn, run_id=ev["run_id"])
            if ev["name"] == _STACKS_EVENT:
                self._attach_stacks(conn, run, ev, now)
                continue
            details = dict(ev.get("details") or {})
            collective = details.get("collective", "unknown")
            if ev.get("step") is None and ev.get("rank") is not None:
                # The step it was stuck in: the one after the last its rank reported.
                last = {int(r["rank"]): int(r["step"]) for r in repo.rank_progress(
                    conn, run_id=run["id"], attempt=int(ev["attempt"]))}.get(int(ev["rank"]))
                ev = {**ev, "step": None if last is None else last + 1}
            where = f"rank {ev['rank']}" + (f" on node {ev['node']}" if ev.get("node") else "")
            finding = policy.FindingFacts(
                kind=_FAILURE_EVENTS[ev["name"]], severity="incident",
                message=f"{ev['name'].replace('_', ' ')} in {collective} on {where}: "
                        f"{ev['message']}",
                attempt=int(ev["attempt"]), step=ev.get("step"), rank=ev.get("rank"),
                node=ev.get("node"), details={"collective": collective, "event_id": ev["id"],
                                              **details})
            rep.findings += 1
            self._decide(conn, run, finding, now, rep)

    def _attach_stacks(self, conn: Connection, run: dict, ev: dict, now: float) -> None:
        details = ev.get("details") or {}
        incident_id = None
        if isinstance(details.get("command_id"), int):
            incident_id = repo.incident_for_command(conn, command_id=details["command_id"])
        if incident_id is None:  # the agent's own watchdog: the hang of that attempt
            hangs = repo.incidents_of(conn, run_id=run["id"], attempt=ev["attempt"],
                                      kinds=["hang"])
            incident_id = hangs[-1]["id"] if hangs else None
        if incident_id is None:
            self._unattached.append(ev)  # the exit that opens the hang incident may follow
            return
        inc = repo.get_incident(conn, incident_id=incident_id)
        assert inc is not None
        merged = {**(inc["details"] or {}),
                  "stacks": {**((inc["details"] or {}).get("stacks") or {}),
                             **(details.get("stacks") or {})},
                  "stacks_node": ev.get("node")}
        repo.update_incident(conn, incident_id=incident_id, details=merged, updated_at=now)

    def _observe(self, conn: Connection, run: dict, now: float) -> Observation | None:
        """Run the detectors on the run's windows (reads only)."""
        cfg = self.detection
        started = observe.attempt_started_at(conn, run)
        if started is None:
            return None  # a restart is under way: judge the new attempt once it runs
        since = max(self.observing_since, started)
        agents = repo.agent_liveness(conn, run_id=run["id"])
        findings: list[Finding] = []
        findings += observe.hang_findings(conn, run, now=now,
                                          observing_since=self.observing_since, cfg=cfg,
                                          agents=agents, started=started)
        findings += observe.lost_node_findings(conn, run, now=now, observing_since=since,
                                               cfg=cfg, agents=agents)
        slow: dict[int | None, Finding] | None = None
        last_at, cost = self._straggler_at.get(int(run["id"]), (float("-inf"), 0.0))
        if now - last_at >= max(cfg.straggler_interval_s, cfg.straggler_cost_factor * cost):
            t0 = time.perf_counter()
            open_stragglers = {int(i["rank"]) for i in repo.incidents_of(
                conn, run_id=run["id"], kinds=["straggler"], status="open")
                if i["rank"] is not None}
            window = self._phase_windows.setdefault(
                int(run["id"]), observe.PhaseWindow(cfg.straggler_table_steps))
            stragglers = observe.straggler_findings(conn, run, cfg=cfg,
                                                    open_ranks=open_stragglers, window=window)
            findings += stragglers
            slow = {f.rank: f for f in stragglers}
            self._straggler_at[int(run["id"])] = (now, time.perf_counter() - t0)
        seen = self._loss_seen.get(int(run["id"]))
        rows = observe.loss_rows(conn, run, cfg=cfg, seen_step=seen[1] if seen and
                                 seen[0] == int(run["attempt"]) else None)
        if rows:
            self._loss_seen[int(run["id"])] = (int(run["attempt"]), int(rows[-1]["step"]))
        findings += observe.loss_findings(rows, cfg=cfg)
        findings += observe.throughput_findings(rows, cfg=cfg)
        findings += observe.disk_findings(conn, run, cfg=cfg, agents=agents)
        return Observation(attempt=int(run["attempt"]), findings=findings, stragglers=slow)

    def _act_on(self, conn: Connection, run: dict, obs: Observation, now: float,
                rep: TickReport) -> None:
        """Hand one run's findings to the policy and apply its decisions."""
        if obs.stragglers is not None:
            self._resolve_ended_stragglers(conn, run, obs.stragglers, now)
        for f in obs.findings:
            if f.kind == "rank_stalled":
                continue  # its hang (if it is one) is judged by the hang finding
            rep.findings += 1
            facts = policy.FindingFacts(
                kind=f.kind, severity=f.severity, message=f.message,
                attempt=obs.attempt, step=f.step, rank=f.rank, node=f.node,
                details=_jsonable(f.details))
            self._decide(conn, run, facts, now, rep)
            run = repo.get_run(conn, run_id=run["id"])  # a decision may have moved it

    def _resolve_ended_stragglers(self, conn: Connection, run: dict,
                                  slow: dict[int | None, Finding], now: float) -> None:
        """One episode, one incident: while its rank is flagged the incident is updated;
        it is resolved once the rank has not been flagged for a whole hold window (a score
        near the threshold flickers, and that must not open and close incidents)."""
        span = repo.step_range(conn, run_id=run["id"], attempt=run["attempt"])
        newest = span[1] if span else None
        hold = max(self.detection.straggler.hold_steps, self.detection.straggler.window_steps)
        for inc in repo.incidents_of(conn, run_id=run["id"], kinds=["straggler"],
                                     status="open"):
            details = dict(inc["details"] or {})
            f = slow.get(inc["rank"])
            if f is not None:
                fresh = {**details, "last_flagged_step": newest,
                         "score": f.details.get("score")}
                if fresh != details:  # touch the row only when the episode moved on
                    repo.update_incident(conn, incident_id=inc["id"], details=fresh,
                                         updated_at=now)
                continue
            last = details.get("last_flagged_step", details.get("flagged_at_step"))
            if inc["attempt"] != run["attempt"] or newest is None or last is None \
                    or newest - int(last) >= hold:
                repo.resolve_incident(conn, incident_id=inc["id"], now=now)

    def _decide(self, conn: Connection, run: dict, finding: policy.FindingFacts, now: float,
                rep: TickReport) -> None:
        this_attempt = repo.incidents_of(conn, run_id=run["id"], attempt=run["attempt"])
        open_watch = frozenset(
            (i["kind"], i["rank"] if i["kind"] == "straggler" else None)
            for i in repo.incidents_of(conn, run_id=run["id"], status="open")
            if i["kind"] in policy.WATCH_KINDS)
        ckpt = repo.newest_complete_checkpoint(conn, run_id=run["id"])
        decision = policy.on_finding(
            actions.facts(run), finding,
            incident_kinds_this_attempt=frozenset(i["kind"] for i in this_attempt),
            open_watch=open_watch, checkpoint=ckpt["path"] if ckpt else None,
            cfg=self.cfg, now=now,
            recovery=actions.recovery(conn, run, _named_steps(finding)))
        if isinstance(decision, policy.Note):
            return
        if not isinstance(decision, policy.RecordEvent):
            rep.decisions += 1
            log.info("run %s: %s", run["name"], decision)
        elif decision.name not in _EPISODE_EVENTS and _seen_event(conn, run, decision):
            return
        actions.apply(conn, run=run, decision=decision, now=now)

    def run(self, stop: threading.Event, interval_s: float) -> None:
        """Tick until ``stop`` is set; an error in one tick is logged, the loop goes on."""
        while not stop.wait(interval_s):
            try:
                self.tick()
            except Exception:
                log.exception("evaluator tick failed")

    def start(self, interval_s: float) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        th = threading.Thread(target=self.run, args=(stop, interval_s),
                              name="trainwarden-evaluator", daemon=True)
        th.start()
        return th, stop


def _named_steps(f: policy.FindingFacts) -> list[int]:
    """The steps whose batch index a decision on ``f`` may name: its step, the start of a
    spike before it (a loss that climbed to NaN) and where it was detected (a rollback skips
    from the start through the detection)."""
    steps = [f.step, f.details.get("start_step"), f.details.get("detected_at_step")]
    return sorted({s for s in steps if isinstance(s, int) and not isinstance(s, bool)})


def _seen_event(conn: Connection, run: dict, d: policy.RecordEvent) -> bool:
    """An event finding is recorded once per episode (same name and start step)."""
    prev = repo.latest_event(conn, run_id=run["id"], attempt=run["attempt"], name=d.name)
    return prev is not None and prev.get("step") == d.step


def _jsonable(d: dict) -> dict:
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

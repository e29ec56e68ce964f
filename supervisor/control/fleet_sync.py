"""The fleet's share of the supervisor: Slurm (``supervisor.fleet``) kept in step with the
health ledger, every ``fleet.interval_s``, in a thread of its own (the scheduler's commands
never run inside a database transaction nor in the evaluator's tick).

Each round reads the scheduler's node states, asks the policy what they and the ledger call
for (``policy.fleet_decisions``), writes the ledger's changes (audited host actions whose
actor is ``fleet``), then runs the scheduler's commands (drain, resume) and records each as a
``fleet_command`` host action with the command line and its output, failed or not.  A
command that failed is tried again after ``fleet.retry_s``, each attempt recorded and logged.

What the supervisor may do is checked at start (``Fleet.check``): a supervisor that may not
drain says so (an error in its log and ``trainwarden_fleet_ok`` 0, which the
``TrainwardenFleetCommandsFailing`` alert reads), and so does every failed command
(``trainwarden_fleet_command_failures_total``); the ledger works on as without a fleet.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainwarden.agent.core.bounds import bounded, check
from trainwarden.supervisor.control import actions, policy
from trainwarden.supervisor.enums import (
    Actor,
    HostActionKind,
    PresenceEvent,
    RunStatus,
    SupervisorEvent,
)
from trainwarden.supervisor.fleet import Fleet, FleetJob, FleetResult
from trainwarden.supervisor.store import hosts, registry, windows
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection, Database
from trainwarden.supervisor.store.rows import RunRow

log = logging.getLogger("trainwarden.fleet")

BACKENDS = ("", "slurm")


@dataclass(frozen=True)
class FleetConfig:
    SECTION: ClassVar[str] = "fleet"

    # The scheduler that owns the nodes: "" (none) or "slurm" (drain and resume with
    # scontrol; Slurm's drained and down nodes read cordoned); hosts are Slurm node names
    backend: str = ""
    interval_s: float = bounded(2.0, gt=0)  # how often the scheduler's node states are read
    command_timeout_s: float = bounded(10.0, gt=0)  # a scheduler command's deadline
    # how long after a failed drain or resume of a node it is tried again
    retry_s: float = bounded(30.0, gt=0)
    # A run whose attempt stands by for a node (a member lost, no spare free, the run may not
    # shrink) is requeued in the scheduler instead, when the scheduler runs the job its agents
    # named on the run's nodes and the job's comment names the run (trainwarden-run=RUN): the
    # job's next allocation excludes the lost node (drained first when its agent was trusted
    # for the host) and goes on as the same run
    requeue: bool = False

    def __post_init__(self) -> None:
        check(self)
        if self.backend not in BACKENDS:
            raise ValueError(f"fleet.backend must be one of {', '.join(map(repr, BACKENDS))}, "
                             f"got {self.backend!r}")
        if self.requeue and not self.backend:
            raise ValueError("fleet.requeue needs a fleet backend (--fleet slurm): without "
                             "one there is no job to requeue")


def make_fleet(cfg: FleetConfig) -> Fleet | None:
    if cfg.backend == "slurm":
        from trainwarden.supervisor.fleet.slurm import SlurmFleet

        return SlurmFleet(timeout_s=cfg.command_timeout_s)
    return None


@dataclass
class FleetStatus:
    """What ``/metrics`` and the API show of the fleet."""

    backend: str
    ok: bool | None = None  # the start's check and the last command: None before any
    message: str = ""
    command_failures: int = 0
    last_error: str = ""
    failed_at: dict[tuple[str, str], float] = field(default_factory=dict)  # (op, node or job) -> t


class FleetSync:
    def __init__(self, db: Database, fleet: Fleet, cfg: FleetConfig,
                 clock: Callable[[], float],
                 leading: Callable[[], bool] = lambda: True) -> None:
        self.db, self.fleet, self.cfg = db, fleet, cfg
        self.clock = clock
        self.leading = leading  # on Postgres replicas, only the evaluator's leader acts
        self.status = FleetStatus(backend=fleet.name)

    def _now(self) -> float:
        return float(self.clock())

    def start_check(self) -> FleetResult:
        r = self.fleet.check()
        self.status.ok, self.status.message = r.ok, r.describe()
        if r.ok:
            log.info("fleet %s: %s", self.fleet.name, r.describe())
        else:
            self.status.last_error = r.describe()
            self.status.command_failures += 1
            log.error("fleet %s: the supervisor cannot drain nodes here, cordons stay in "
                      "trainwarden only: %s", self.fleet.name, r.describe())
        return r

    def round(self) -> policy.FleetPlan:
        """One round: read, decide, write the ledger, run the commands."""
        nodes, read = self.fleet.node_states()
        if not read.ok:
            self._failed(read)
            return policy.FleetPlan()
        now = self._now()
        with self.db.write() as conn:
            ledger = {n: (h["state"], h["actor"], h["reason"])
                      for n, h in hosts.host_states(conn).items()}
            plan = policy.fleet_decisions(ledger, nodes)
            for d in plan.ledger:
                actions.apply_host(conn, decision=d, now=now)
                log.warning("fleet %s: %s", self.fleet.name, d.reason)
        for node, reason in plan.drain:
            self._command("drain", node, functools.partial(self.fleet.cordon, node, reason))
        for node in plan.resume:
            self._command("resume", node, functools.partial(self.fleet.uncordon, node))
        if self.cfg.requeue:
            self.requeue_round()
        return plan

    def requeue_round(self) -> list[policy.Requeue]:
        """Requeue the job of each run whose attempt stands by for a node
        (``policy.requeue_when_no_spare``), once the scheduler confirms the job the agents
        named is the run's (``policy.requeue_checked``: it runs on the run's nodes and its
        comment names the run): the waiting nodes are cordoned (in the shared ledger and
        drained when their agents were trusted for the host, in the run only otherwise), then
        the job is requeued off them; each command is audited, the requeue is the run's
        ``requeued`` event, and a refusal its ``requeue_refused``."""
        wanted: list[tuple[RunRow, policy.RequeueWanted, set[str], dict[str, bool]]] = []
        with self.db.read() as conn:
            active = registry.active_runs(conn)
            named = {int(r["id"]): _scheduler_job(conn, int(r["id"])) for r in active}
            for run in active:
                if run["status"] != RunStatus.RESTARTING:
                    continue
                _, nodes = actions.waiting_for(conn, run)
                if not nodes:
                    continue
                d = policy.requeue_when_no_spare(
                    enabled=self.cfg.requeue, attempt=int(run["attempt"]),
                    waiting=_why_waiting(conn, run, nodes), job=named[int(run["id"])],
                    requeued_for=_requeued_for(conn, int(run["id"])))
                if isinstance(d, policy.RequeueWanted):
                    wanted.append((run, d, actions.restart_members(conn, run),
                                   hosts.node_trust(conn, run_id=int(run["id"]))))
        done = []
        for run, want, members, trusted in wanted:
            run_id = int(run["id"])
            now = self._now()
            last = self.status.failed_at.get((f"requeue {run_id}", want.job))
            if last is not None and now - last < self.cfg.retry_s:
                continue
            scheduled, said = self.fleet.job(want.job)
            check = policy.requeue_checked(
                want, run_id=run_id, run=str(run["name"]), scheduled=scheduled,
                said=said.describe(),
                members=members, trusted=trusted,
                named_by=[str(r["name"]) for r in active
                          if named[int(r["id"])] == want.job and int(r["id"]) != run_id])
            if isinstance(check, policy.Note):
                self.status.failed_at[(f"requeue {run_id}", want.job)] = now
                self._refused(run_id, want, check, said)
                continue
            assert scheduled is not None
            if self._requeue(run_id, check, scheduled):
                done.append(check)
        return done

    def _refused(self, run_id: int, want: policy.RequeueWanted, note: policy.Note,
                 said: FleetResult) -> None:
        """A requeue the scheduler's word refused: the run's ``requeue_refused`` event, once
        per attempt and reason, and the log every time it is checked."""
        log.warning("fleet %s: %s", self.fleet.name, note.why)
        with self.db.write() as conn:
            ev = windows.latest_run_event(conn, run_id=run_id,
                                          name=SupervisorEvent.REQUEUE_REFUSED)
            before: dict[str, Any] = (ev["details"] if ev is not None else None) or {}
            if before.get("attempt") == want.attempt and ev is not None \
                    and ev["message"] == note.why:
                return
            rec.insert_event(conn, run_id=run_id, agent_id=None, attempt=want.attempt,
                             rank=None, t=self._now(), name=SupervisorEvent.REQUEUE_REFUSED,
                             step=None, message=note.why,
                             details={"job": want.job, "attempt": want.attempt,
                                      "command": said.command, "ok": said.ok,
                                      "output": said.output[:1000]})

    def _requeue(self, run_id: int, d: policy.Requeue, job: FleetJob) -> bool:
        now = self._now()
        with self.db.write() as conn:
            shared = hosts.cordoned_nodes(conn)
            here = hosts.run_cordons(conn, run_id=run_id)
            for c in d.cordons:
                if c.node not in shared and not (c.in_run_only and c.node in here):
                    actions.apply_host(conn, decision=c, now=now)
        for node, reason in d.drain:
            self._command("drain", node, functools.partial(self.fleet.cordon, node, reason))
        results = self.fleet.requeue(job, d.exclude)
        requeued, ok = results[0].ok, all(r.ok for r in results)
        said = "; ".join(r.describe() for r in results)
        with self.db.write() as conn:
            rec.insert_event(conn, run_id=run_id, agent_id=None, attempt=d.attempt, rank=None,
                             t=self._now(), name=SupervisorEvent.REQUEUED, step=None,
                             message=f"{d.reason}: {said}",
                             details={"job": d.job, "attempt": d.attempt, "ok": requeued,
                                      "drained": [n for n, _ in d.drain],
                                      "excluded": list(d.exclude),
                                      "in_run_only": [c.node for c in d.cordons
                                                      if c.in_run_only],
                                      "commands": [{"command": r.command, "ok": r.ok,
                                                    "output": r.output[:1000]}
                                                   for r in results],
                                      "command": results[0].command,
                                      "output": results[0].output[:1000]})
        for r in results:
            if not r.ok:
                self._failed(r)
        if not requeued:
            self.status.failed_at[(f"requeue {run_id}", d.job)] = now
            return False
        self.status.failed_at.pop((f"requeue {run_id}", d.job), None)
        (log.warning if ok else log.error)("fleet %s: %s: %s", self.fleet.name, d.reason, said)
        return True

    def _command(self, op: str, node: str, run: Callable[[], FleetResult]) -> None:
        now = self._now()
        last = self.status.failed_at.get((op, node))
        if last is not None and now - last < self.cfg.retry_s:
            return
        r = run()
        with self.db.write() as conn:
            hosts.record_host_action(conn, node=node, kind=HostActionKind.FLEET_COMMAND,
                                     actor=Actor.FLEET, reason=f"{op}: {r.describe()}",
                                     now=self._now())
        if r.ok:
            self.status.failed_at.pop((op, node), None)
            self.status.ok = True
            log.info("fleet %s: %s %s: %s", self.fleet.name, op, node, r.describe())
        else:
            self.status.failed_at[(op, node)] = now
            self._failed(r)

    def _failed(self, r: FleetResult) -> None:
        self.status.ok = False
        self.status.command_failures += 1
        self.status.last_error = r.describe()
        log.error("fleet %s: %s", self.fleet.name, r.describe())

    def run(self, stop: threading.Event) -> None:
        self.start_check()
        while not stop.is_set():
            try:
                if self.leading():
                    self.round()
            except Exception:
                log.exception("fleet %s: a round failed", self.fleet.name)
            stop.wait(self.cfg.interval_s)

    def start(self) -> tuple[threading.Thread, threading.Event]:
        stop = threading.Event()
        th = threading.Thread(target=self.run, args=(stop,), name="trainwarden-fleet",
                              daemon=True)
        th.start()
        return th, stop


def _why_waiting(conn: Connection, run: RunRow, nodes: set[str]) -> dict[str, str]:
    """node -> why the attempt stands by for it (the words of the ``waiting_for_node`` event
    its restart recorded, under the attempt before it)."""
    ev = windows.latest_run_event(conn, run_id=int(run["id"]),
                                  name=SupervisorEvent.WAITING_FOR_NODE)
    details: dict[str, Any] = (ev["details"] if ev is not None else None) or {}
    said = [str(v) for v in (details.get("waiting") or {}).values()]
    out = {}
    for n in nodes:
        why = next((w for w in said if w.split(" ", 1)[0] == n), f"{n} missing")
        out[n] = why.split(" ", 1)[-1] if " " in why else "missing"
    return out


def _scheduler_job(conn: Connection, run_id: int) -> str:
    """The scheduler job the run's newest agent registration named ("" without one)."""
    ev = windows.latest_run_event(conn, run_id=run_id, name=PresenceEvent.AGENT_REGISTERED)
    details: dict[str, Any] = (ev["details"] if ev is not None else None) or {}
    job = details.get("scheduler_job")
    return job if isinstance(job, str) else ""


def _requeued_for(conn: Connection, run_id: int) -> int | None:
    """The attempt the run's last successful requeue was for (None: never requeued)."""
    ev = windows.latest_run_event(conn, run_id=run_id, name=SupervisorEvent.REQUEUED)
    d: dict[str, Any] = (ev["details"] if ev is not None else None) or {}
    return int(d["attempt"]) if d.get("ok") and isinstance(d.get("attempt"), int) else None

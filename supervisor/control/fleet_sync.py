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
from typing import ClassVar

from trainwarden.agent.core.bounds import bounded, check
from trainwarden.supervisor.control import actions, policy
from trainwarden.supervisor.enums import Actor, HostActionKind
from trainwarden.supervisor.fleet import Fleet, FleetResult
from trainwarden.supervisor.store import hosts
from trainwarden.supervisor.store.db import Database

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

    def __post_init__(self) -> None:
        check(self)
        if self.backend not in BACKENDS:
            raise ValueError(f"fleet.backend must be one of {', '.join(map(repr, BACKENDS))}, "
                             f"got {self.backend!r}")


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
    failed_at: dict[tuple[str, str], float] = field(default_factory=dict)  # (op, node) -> t


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
        return plan

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

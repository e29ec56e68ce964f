"""What every part of the evaluator shares: its settings, what it keeps between ticks, and
one run's share of a tick contained in a savepoint of its own."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from trainwarden.agent.core import text as untrusted
from trainwarden.agent.core.bounds import bounded, check
from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.detection import DetectionConfig, lost_deadline
from trainwarden.supervisor.control.goodput_feed import GoodputFeed
from trainwarden.supervisor.control.ledger import HealthLedger
from trainwarden.supervisor.control.observer import Observer, ObserverProcess
from trainwarden.supervisor.control.overload import OverloadWatch
from trainwarden.supervisor.control.retention import Retention, RetentionConfig
from trainwarden.supervisor.detect.node_health import CordonConfig
from trainwarden.supervisor.detect.overload import Overload
from trainwarden.supervisor.enums import JudgeStage, SupervisorEvent
from trainwarden.supervisor.ingest.delivery import DeliveryMonitor
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry
from trainwarden.supervisor.store.db import Connection, Database
from trainwarden.supervisor.store.rows import NodeEventRow, RunRow

log = logging.getLogger("trainwarden.evaluator")


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


class EvaluatorBase:
    """The evaluator's state and what each of its parts uses: the store, the policy's settings,
    the clock, the detection settings, and one run's failure kept that run's."""

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

    @property
    def overload(self) -> Overload | None:
        """The last tick's verdict: the supervisor is behind (None: it keeps up)."""
        return self.overload_watch.verdict

    def advised_batch_interval(self) -> float | None:
        """What the ingest reply asks agents to batch at (``policy.advised_batch_interval``,
        decided at the last tick: ingest reads it for every batch)."""
        return self.overload_watch.advice

    def _live_s(self) -> float:
        """A node heard from within this long is live (the node-lost deadline, at the batch
        interval the agents were asked for)."""
        return lost_deadline(self.detection, self.advised_batch_interval()).deadline_s

    def _state(self, run: RunRow) -> RunState:
        state = self._runs.get(int(run["id"]))
        if state is None:
            state = self._runs[int(run["id"])] = RunState()
        return state

"""The agent's life: ``start`` (register, launch), ``tick`` (one iteration: echo torchrun's
output, drain the worker socket, notice torchrun's exit, apply commands, spool a batch when
one is due), the local hang watchdog, the heartbeat, ``shutdown`` and ``run``."""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING, Any

from trainwarden.agent import protocol
from trainwarden.agent.core.states import AgentExit, AgentState, ExitOutcome, NodeRole, exit_for
from trainwarden.agent.executor import Host
from trainwarden.agent.launcher import ExitInfo
from trainwarden.agent.loop.checkpoints import CheckpointsMixin
from trainwarden.agent.loop.identity import IdentityMixin
from trainwarden.agent.monitor import disk_usage
from trainwarden.agent.schedule import batch_due

log = logging.getLogger("trainwarden.agent.loop")


class Agent(IdentityMixin, CheckpointsMixin):
    """The node agent: ``tick()`` is one iteration, ``run()`` a thin loop around it."""

    def start(self) -> None:
        """Kill what a previous incarnation left, learn which run this is (registration,
        bounded by ``register_wait_s``), launch torchrun, start sending.  A run that has
        ended launches nothing: ``result`` is set."""
        killed = self.launcher.kill_leftovers()
        if killed:
            self._emit({"type": "event", "t": self.clock(),
                        "name": protocol.AgentEventName.LEFTOVERS_KILLED,
                        "message": f"killed {len(killed)} process(es) of a previous agent",
                        "details": {"pids": killed}})
        self._identify()
        if self.result is not None:
            return
        if self.role == NodeRole.SPARE:
            self.set_state(AgentState.SPARE)
            log.info("a spare of run %s: running nothing until the supervisor gives this node "
                     "a node rank", self.cfg.run)
        else:
            self.launch(self._attempt, self.plan_path)
        if self.threaded_uplink:
            self.uplink.start()

    def tick(self) -> int | None:
        """One iteration; returns the agent's exit code once it should end."""
        self._check_wake()
        self.launcher.pump_output()
        self.receiver.drain()
        for msg in self.receiver.take():
            self._emit(msg)
            self.watch.observe(msg)
            if msg.get("type") == "step" and self.state == AgentState.STARTING:
                self.set_state(AgentState.RUNNING)
            elif msg.get("type") == "checkpoint":
                self._learn_checkpoint(msg)
        if self.launcher.stopping:
            self.launcher.stop_step()
        self._check_exit()
        self.executor.submit(self.uplink.take_commands())
        self._apply_protection()
        self.executor.tick()
        self._check_role()
        if self.launcher.stopping:
            self.launcher.stop_step()
        if self.state == AgentState.STOPPING and self.stopped():
            self.set_state(AgentState.STOPPED)  # e.g. a restart waiting for its not_before
        if self.urgent or self.batch_due():
            self.send_batch()
        if not self.threaded_uplink:
            self.uplink.pump()
        self._check_local_hang()  # after the uplink: judge the supervisor's silence fresh
        self._check_registration()
        return self.result

    def _check_local_hang(self) -> None:
        """Act on a hang ourselves only while the supervisor has been silent for longer than
        the hang deadline (otherwise it decides, for every node of the run at once)."""
        if (not self.launcher.running or self.launcher.stopping or self.executor.busy
                or self.state not in (AgentState.STARTING, AgentState.RUNNING)):
            return
        now = self.clock()
        silent_since = self.uplink.last_ok if self.uplink.last_ok is not None \
            else self.started_at
        if now - silent_since <= self.watch.deadline_s():
            return
        finding = self.watch.check(now)
        if finding is None:
            return
        log.error("local watchdog: %s (supervisor silent for %.0f s): dumping stacks, "
                  "killing the workers", finding.message, now - silent_since)
        self.collect_stacks(f"local watchdog: {finding.message}", None)
        self._emit({"type": "event", "t": now, "attempt": self._attempt,
                    "name": protocol.AgentEventName.LOCAL_HANG, "message": finding.message,
                    "step": finding.step, "details": dict(finding.details)})
        self._hung_attempt = self._attempt
        self.begin_stop(immediate=True)

    def collect_stacks(self, reason: str, command_id: int | None) -> None:
        """Dump every worker's Python stacks and send them as a ``stacks`` event."""
        stacks = self.launcher.dump_stacks() if self.launcher.running else {}
        log.warning("collected the stacks of %d worker(s): %s", len(stacks), reason)
        self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                    "name": protocol.AgentEventName.STACKS,
                    "message": f"python stacks of {len(stacks)} worker(s): {reason}",
                    "details": {"stacks": {str(r): text for r, text in stacks.items()},
                                "reason": reason, "command_id": command_id}})

    def _check_exit(self) -> None:
        info = self.launcher.poll()
        if info is None or self.exit_reported:
            return
        self.exit_reported = True
        outcome = ExitOutcome.HUNG if info.attempt == self._hung_attempt else self.outcome(info)
        self._emit({
            "type": "exit", "t": info.t, "attempt": info.attempt,
            "exit_code": info.exit_code, "signal": info.signal, "outcome": outcome,
            "failed_ranks": info.failed_ranks,
        })
        if outcome != ExitOutcome.STOPPED:
            # torchrun is gone; sweep whatever it left (a SIGKILLed torchrun orphans its
            # workers, which would otherwise train on unsupervised or hang in a collective).
            self.launcher.begin_stop()
        if outcome == ExitOutcome.COMPLETED:
            self.set_state(AgentState.FINISHED)
            self.result = AgentExit.COMPLETED
        elif outcome in (ExitOutcome.CRASHED, ExitOutcome.HUNG):
            # keep running: the supervisor decides (restart or stop)
            self.set_state(AgentState.FAILED)
        else:
            self.set_state(AgentState.STOPPED)

    @staticmethod
    def outcome(info: ExitInfo) -> ExitOutcome:
        if info.stop_requested:
            return ExitOutcome.STOPPED
        return ExitOutcome.COMPLETED if info.exit_code == 0 else ExitOutcome.CRASHED

    def finish(self, end: object) -> None:
        """A stop command ended the run (``end``: how, as the command says): the agent exits
        with that end's code once it has delivered what it spooled."""
        self.set_state(AgentState.STOPPED)
        self.result = exit_for(end)
        log.info("the run ended (%s): leaving with exit code %d", end or "stopped",
                 self.result)

    def heartbeat(self) -> dict[str, Any]:
        workers = self.stats.collect(self.launcher.pid) if self.launcher.running else []
        if workers and self.state == AgentState.STARTING:
            self.set_state(AgentState.RUNNING)
        now = self.clock()
        disk = disk_usage(self.roots.free_space_at)
        hb: dict[str, Any] = {
            "type": "heartbeat", "t": now, "attempt": self._attempt,
            "state": self.state,
            "workers": workers,
            "disk_free_bytes": disk[0] if disk else None,
            "disk_total_bytes": disk[1] if disk else None,
        }
        # GPU readings change slowly and cost NVML calls: every gpu_interval_s, and the
        # supervisor keeps the last one between them.
        if now - self._gpus_read_at >= self.cfg.gpu_interval_s:
            self._gpus_read_at = now
            hb["gpus"] = self.gpus.read()
        return hb

    def batch_interval_s(self) -> float:
        """Ours, or the longer one an overloaded supervisor asked for (events that cannot
        wait, an exit, a crash, still go at once: ``urgent``)."""
        return max(self.cfg.batch_interval_s, self.uplink.advised_interval_s or 0.0)

    def batch_due(self) -> bool:
        """Whether this agent's next regular batch is due: at its own phase of the
        current batch interval (``trainwarden.agent.schedule``)."""
        return batch_due(now=self.clock(), last=self.last_batch,
                         interval_s=self.batch_interval_s(), phase=self.batch_phase)

    def send_batch(self) -> None:
        items, self.pending = self.pending, []
        self.urgent = False
        self.last_batch = self.clock()
        self.uplink.enqueue(items, self.heartbeat(), self._attempt)

    def shutdown(self, reason: str) -> None:
        """Stop the workers (group SIGTERM, then SIGKILL), report, flush (bounded)."""
        if self.launcher.running or self.launcher.stopping:
            log.info("stopping workers: %s", reason)
            self.set_state(AgentState.STOPPING)
            self.launcher.stop()
        self.launcher.pump_output()
        self.receiver.drain()
        for msg in self.receiver.take():
            self._emit(msg)
        self._check_exit()
        if self.launcher.stopping:
            self.launcher.stop()  # the sweep begun by _check_exit
        self.send_batch()
        if not self.uplink.flush(self.cfg.flush_timeout_s):
            log.warning("%d batch(es) not delivered; they stay in %s for the next agent",
                        self.uplink.pending, self.uplink.spool.dir)

    def close(self) -> None:
        self.uplink.close()
        self.receiver.close()
        self._lock.close()  # releases the flock

    def request_stop(self, signum: int, _frame: FrameType | None = None) -> None:
        self._signal = signum

    def run(self) -> int:
        """Start, tick until done or signalled, shut down; returns the exit code."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, self.request_stop)
        code: int = AgentExit.ERROR
        try:
            try:
                self.start()
            except OSError as e:  # the command cannot be run at all (not found, not allowed)
                log.error("cannot start %r: %s", self.cfg.command[0], e)
                return AgentExit.NOT_FOUND
            if self.result is not None:  # refused before any worker started
                return self.result
            while True:
                if self._signal is not None:
                    log.info("agent got %s: shutting down", signal.Signals(self._signal).name)
                    self.shutdown(f"agent got {signal.Signals(self._signal).name}")
                    code = 0
                    break
                result = self.tick()
                if result is not None:
                    self.shutdown("run ended")
                    code = result
                    break
                time.sleep(self.cfg.tick_interval_s)
        except BaseException:
            log.exception("agent failed; stopping the workers")
            try:
                self.launcher.stop()
            finally:
                raise
        finally:
            self.close()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return code


if TYPE_CHECKING:
    def _is_host(agent: Agent) -> Host:  # the whole Agent is the executor's host (base.py)
        return agent

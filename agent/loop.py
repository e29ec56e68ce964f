"""The agent: ``tick()`` is one iteration, ``run()`` a thin loop around it.

One tick: echo torchrun's output, drain the worker socket, notice torchrun's exit, apply
commands, and spool a batch when one is due (every ``batch_interval_s``, at the agent's own
phase of it: ``trainwarden.agent.schedule``; at once when an event, checkpoint, exit or command
result is
waiting).  The network is the uplink thread's business; a tick never waits on it.

Before launching, the agent registers (for at most ``register_wait_s``): the reply names the
run, by the uuid the supervisor gave it at creation, and the local state must belong to that
run.  A state of another run (another uuid, or one saved before runs had one: a reused run
name) is archived beside the state dir and replaced, so no worker starts at its attempt or
from its resume plan; a run that has ended refuses the registration, and nothing is launched.
A supervisor that does not answer in time delays training by that wait only: the workers
start from the local state, and a foreign state found once it answers is replaced then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from trainwarden.agent import protocol
from trainwarden.agent.config import AgentConfig
from trainwarden.agent.core import text as untrusted
from trainwarden.agent.core.launch import Membership, declared_world_size, rewrite
from trainwarden.agent.core.states import (
    AGENT_TRANSITIONS,
    AgentExit,
    AgentState,
    ExitOutcome,
    NodeRole,
    exit_for,
)
from trainwarden.agent.executor import Executor
from trainwarden.agent.launcher import ExitInfo, Launcher, PopenFactory
from trainwarden.agent.monitor import DatagramReceiver, GpuHealth, WorkerStats, disk_usage, hostname
from trainwarden.agent.pins import CheckpointPins
from trainwarden.agent.roots import CheckpointRoots
from trainwarden.agent.schedule import batch_due
from trainwarden.agent.statefile import load_json, save_json
from trainwarden.agent.uplink import Uplink
from trainwarden.agent.version import version
from trainwarden.agent.watchdog import HangWatch

log = logging.getLogger(__name__)
# What the error an agent state move outside ``AGENT_TRANSITIONS`` logs begins with.
UNLISTED_MOVE = "unlisted agent state move:"

AGENT_VERSION = version()
_URGENT_TYPES = {"event", "checkpoint", "exit", "command_result"}

# The supervisor refused the registration (the run has ended): nothing was launched.
EXIT_REFUSED = AgentExit.REFUSED


class AgentAlreadyRunning(RuntimeError):
    """Another live agent holds this state dir (two agents would fight over one tree)."""


def _lock_state_dir(state_dir: Path) -> Any:
    """An exclusive ``flock`` on the state dir, held for the agent's life.  The kernel drops it
    when the agent dies however it dies, so a restarted agent gets it back at once."""
    f = open(state_dir / "agent.lock", "a+")  # noqa: SIM115 (held open on purpose)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read().strip() or "?"
        f.close()
        raise AgentAlreadyRunning(
            f"another agent (pid {other}) is running with state dir {state_dir}: stop it "
            "first, or give this one its own --state-dir / --node"
        ) from None
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


class Agent:
    def __init__(
        self,
        config: AgentConfig,
        *,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.time,
        popen: PopenFactory = subprocess.Popen,
        threaded_uplink: bool = True,
        echo: bool = True,
        gpu_module: Any = None,
        batch_phase: float | None = None,
    ) -> None:
        self.cfg = config
        self.clock = clock
        self.state_dir = config.state
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock = _lock_state_dir(self.state_dir)
        self.state_path = self.state_dir / "agent.json"
        self.threaded_uplink = threaded_uplink
        self._transport = transport
        self.launcher = Launcher(
            config.command, run=config.run, node=config.node, state_dir=self.state_dir,
            socket_path=config.socket_path, stop_grace_s=config.stop_grace_s,
            worker_env=config.worker_env, echo=echo, popen=popen, clock=clock,
        )
        self.receiver = DatagramReceiver(config.socket_path, config.queue_max)
        self.stats = WorkerStats()
        self.gpus = GpuHealth(gpu_module)
        self._gpus_read_at = float("-inf")
        self.pending: list[dict[str, Any]] = []
        self.urgent = False
        self.state: AgentState = AgentState.STARTING  # its first; ``set_state`` moves it
        self.exit_reported = False
        self.result: int | None = None  # set when the agent should end, with its exit code
        self.last_batch = float("-inf")
        # This agent's phase of the batch interval (``trainwarden.agent.schedule``): drawn per
        # agent so
        # the nodes of a run spread their batches evenly, whatever interval they are asked for.
        self.batch_phase = random.random() if batch_phase is None else batch_phase
        self._signal: int | None = None
        self._registered_attempt_checked = False
        # Launched before the supervisor answered (its membership unknown): the first
        # registration reply realigns the workers with it.
        self._launched_unregistered = False
        self.started_at = clock()
        self.watch = HangWatch(config.hang)
        self._hung_attempt: int | None = None
        self.archived: Path | None = None  # where another run's state was moved aside
        # What this node is in the run: a spare runs nothing; a member runs the command
        # rewritten for its membership (``trainwarden.agent.core.launch``).  None: the
        # supervisor has not said (the user's command runs as it is).
        self.role = NodeRole.SPARE if config.spare else NodeRole.MEMBER
        self.membership: Membership | None = None
        self.node_lost_s: float | None = None  # the supervisor's node-lost deadline
        self._last_tick = clock()
        self._open_state()

    def _open_state(self) -> None:
        """Read the state dir's files (attempt, plan, pins, the run's uuid) and build the
        parts that live in it: the uplink (spool, sequence numbers) and the executor."""
        saved = self._load_state()
        # No agent.json yet: a state this agent creates, bound to no run until registered.
        # One found without a uuid was saved before runs had one: it may be any run's.
        self._unbound = not self.state_path.exists()
        uuid = saved.get("run_uuid")
        self.run_uuid: str | None = uuid if isinstance(uuid, str) and uuid else None
        self._attempt = int(saved.get("attempt", 0))
        plan = saved.get("plan")
        self.plan_path: Path | None = Path(plan) if plan and Path(plan).exists() else None
        self._restore_membership(saved)
        # Where checkpoints go: registered, pinned, read for free space (``roots``).
        self.roots = CheckpointRoots(checkpoint_root=self.cfg.checkpoint_root,
                                     command_checkpoint_dir=self.cfg.command_checkpoint_dir,
                                     learned=saved.get("checkpoint_roots"))
        config, clock = self.cfg, self.clock
        self.uplink = Uplink(
            supervisor_url=config.supervisor_url, token=config.token,
            state_dir=self.state_dir, register_request=self._register_request(),
            spool_max_bytes=config.spool_max_bytes, spool_max_batches=config.spool_max_batches,
            max_items_per_batch=config.max_items_per_batch,
            max_5xx_tries=config.max_5xx_tries,
            dead_letter_max_bytes=config.dead_letter_max_bytes,
            dead_letter_max_batches=config.dead_letter_max_batches,
            http_timeout_s=config.http_timeout_s, transport=self._transport, clock=clock,
        )
        self.uplink.check_identity = self._is_our_run
        self.executor = Executor(self.state_dir, self, self._emit, clock)
        pins = saved.get("pins")
        # (an agent of an earlier version saved its restart pins as a plain list)
        self.pins = CheckpointPins({"restart": pins} if isinstance(pins, list) else pins,
                                   roots=self.roots.pin_roots())

    # -- the run's identity ------------------------------------------------------------------

    def _is_our_run(self, reply: protocol.RegisterReply) -> bool:
        """Whether the local state belongs to the run the supervisor answered for: the same
        uuid, or a fresh state dir (an older supervisor sends no uuid: the state is kept)."""
        uuid = reply.get("run_uuid")
        return not uuid or uuid == self.run_uuid or (self.run_uuid is None and self._unbound)

    def _adopt(self, reply: protocol.RegisterReply, *, launching: bool) -> None:
        """Record the run's uuid in the state; a new state launched now starts at the run's
        attempt (a node joining a run that has restarted, a state just archived)."""
        uuid = reply.get("run_uuid")
        if not uuid or uuid == self.run_uuid:
            return
        if launching and self._unbound:
            self._attempt, self.plan_path = int(reply.get("attempt") or 0), None
        self.run_uuid, self._unbound = uuid, False
        self._save_state()

    def _archive_state(self, reply: protocol.RegisterReply) -> None:
        """The local state is another run's (a reused run name: another uuid, or a state
        saved before runs had one): move it aside, open a fresh one, and take the run's
        uuid and attempt.  Called with no worker running and the sender thread stopped."""
        self.uplink.close()  # its sender thread writes in the state dir
        old = self.run_uuid
        tag = old or f"no-uuid-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        dest = self.state_dir.with_name(f"{self.state_dir.name}.archived-{tag}")
        n = 1
        while dest.exists():
            n += 1
            dest = dest.with_name(f"{self.state_dir.name}.archived-{tag}-{n}")
        dest.mkdir(parents=True)
        keep = {"agent.lock", self.cfg.socket_path.name}
        for child in list(self.state_dir.iterdir()):
            if child.name not in keep:
                os.replace(child, dest / child.name)
        self.archived = dest
        log.warning(
            "the state in %s belongs to another run named %r (run uuid %s; the supervisor's "
            "run is %s, at attempt %s): archived it to %s and starting afresh, so no worker "
            "starts at its attempt or resumes from its checkpoints", self.state_dir,
            self.cfg.run, old or "none recorded", reply.get("run_uuid"), reply.get("attempt"),
            dest)
        self._open_state()
        self.uplink.adopt_credential(reply)  # the node is ours: the new state proves it
        self._adopt(reply, launching=True)
        self._registered_attempt_checked = False
        self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                    "name": protocol.AgentEventName.STATE_ARCHIVED,
                    "message": f"local agent state of another run (uuid {old or 'none'}) "
                               f"archived to {dest}",
                    "details": {"archived_to": str(dest), "old_run_uuid": old}})

    # -- persisted state ---------------------------------------------------------------------

    def _load_state(self) -> dict[str, Any]:
        return load_json(self.state_path)

    def _save_state(self) -> None:
        plan = str(self.plan_path) if self.plan_path else None
        pins = self.pins.state() if hasattr(self, "pins") else {}
        m = self.membership
        save_json(self.state_path, {"run_uuid": self.run_uuid, "attempt": self._attempt,
                                    "plan": plan, "pins": pins,
                                    "checkpoint_roots": self.roots.learned,
                                    "role": self.role,
                                    "membership": dataclasses.asdict(m) if m else None})

    def _restore_membership(self, saved: dict[str, Any]) -> None:
        """The role and membership this node last knew (a restarted agent relaunches as
        them until the supervisor answers)."""
        with contextlib.suppress(ValueError):
            self.role = NodeRole(saved.get("role", self.role))
        m = saved.get("membership")
        try:
            self.membership = Membership(**m) if isinstance(m, dict) else None
        except TypeError:
            self.membership = None

    # -- membership --------------------------------------------------------------------------

    def _learn_registration(self, reply: protocol.RegisterReply) -> None:
        """What the registration reply says this node is."""
        lost = reply.get("node_lost_s")
        if isinstance(lost, int | float) and lost > 0:
            self.node_lost_s = float(lost)
        view = reply.get("membership")
        if not isinstance(view, dict):
            return  # an older supervisor: the command runs as it is
        self.role = NodeRole(view.get("role") or NodeRole.MEMBER)
        rank, nnodes, ep = view.get("node_rank"), view.get("nnodes"), view.get("endpoint")
        if (self.role == NodeRole.MEMBER and isinstance(rank, int) and isinstance(nnodes, int)
                and isinstance(ep, str) and ep):
            declared = view.get("declared")
            self.membership = Membership(epoch=int(view.get("epoch") or 0), nnodes=nnodes,
                                         node_rank=rank, endpoint=ep,
                                         declared=declared if isinstance(declared, int)
                                         else None)
        else:
            self.membership = None
        self._save_state()

    def place(self, plan: protocol.ResumePlan | None) -> str | None:
        """Take the membership a restart command carries; returns why this node stands by
        (runs nothing: not a member, or a member missing), or None to launch."""
        m = plan.membership if plan is not None else None
        if not isinstance(m, dict):
            return None if self.role == NodeRole.MEMBER else "a spare runs nothing"
        raw = m.get("members")
        members: dict[str, Any] = raw if isinstance(raw, dict) else {}
        rank = members.get(self.cfg.node)
        epoch = int(m.get("epoch") or 0)
        if not isinstance(rank, int):
            self.role, self.membership = NodeRole.SPARE, None
            self._save_state()
            return f"not a member of membership epoch {epoch}: standing by as a spare"
        self.role = NodeRole.MEMBER
        declared = m.get("declared")
        self.membership = Membership(epoch=epoch, nnodes=int(m.get("nnodes") or len(members)),
                                     node_rank=rank, endpoint=str(m.get("endpoint") or ""),
                                     declared=declared if isinstance(declared, int) else None)
        self._save_state()
        waiting = m.get("waiting") or []
        if waiting or not self.membership.endpoint:
            return (f"node rank(s) {', '.join(map(str, waiting))} have no node yet: standing "
                    "by until a spare or the missing node joins")
        return None

    def stand_by(self, attempt: int, reason: str) -> None:
        """Run nothing for ``attempt`` (the executor's restart found this node not to run)."""
        self._attempt = attempt
        self._save_state()
        self.set_state(AgentState.SPARE)
        self._emit({"type": "event", "t": self.clock(), "attempt": attempt,
                    "name": protocol.AgentEventName.STANDING_BY, "message": reason,
                    "details": {"role": self.role}})

    def _check_role(self) -> None:
        """A reply said this node is not a member (it was replaced while it was silent): its
        workers are stopped at once, before they write anything more."""
        told = self.uplink.role
        if told != NodeRole.SPARE or self.role == NodeRole.SPARE or self.executor.busy:
            return
        self.role, self.membership = NodeRole.SPARE, None
        self._save_state()
        running = self.launcher.running or self.launcher.stopping
        log.warning("the supervisor says this node is no longer a member of run %s "
                    "(membership epoch %s): %s", self.cfg.run, self.uplink.epoch,
                    "killing its workers" if running else "standing by as a spare")
        if running:
            self.begin_stop(immediate=True)
        if not running:
            self.set_state(AgentState.SPARE)
        self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                    "name": protocol.AgentEventName.NOT_A_MEMBER,
                    "message": "no longer a member: workers stopped, standing by as a spare",
                    "details": {"epoch": self.uplink.epoch, "workers_killed": running}})

    def _check_wake(self) -> None:
        """This agent (and so its node) was stopped past the node-lost deadline (SIGSTOP, a
        frozen VM): the supervisor may have given its rank to a spare, so its workers are
        killed before they write anything, and the supervisor's next word decides."""
        now = self.clock()
        gap, self._last_tick = now - self._last_tick, now
        if (self.node_lost_s is None or gap <= self.node_lost_s
                or not (self.launcher.running or self.launcher.stopping)):
            return
        log.warning("this agent did not run for %.1f s (past the node-lost deadline of %.0f s):"
                    " killing the workers until the supervisor says what this node is", gap,
                    self.node_lost_s)
        self.begin_stop(immediate=True)
        self._emit({"type": "event", "t": now, "attempt": self._attempt,
                    "name": protocol.AgentEventName.WOKE_UP,
                    "message": f"the agent did not run for {gap:.1f} s: workers killed",
                    "details": {"gap_s": round(gap, 3), "node_lost_s": self.node_lost_s}})

    def _learn_checkpoint(self, msg: dict[str, Any]) -> None:
        learned, registered = self.roots.learn(msg.get("path"))
        if not learned:
            return
        self.pins.roots = self.roots.pin_roots()
        self._save_state()
        if registered:
            # The supervisor refuses a checkpoint outside the roots this agent registered:
            # register again (before the batch carrying this checkpoint goes out).
            self.uplink.update_registration(self._register_request())

    def _report_refused_pins(self) -> None:
        for path, why in self.pins.take_refused():
            self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                        "name": protocol.AgentEventName.PIN_REFUSED,
                        "message": f"refused to pin {path!r}: {why}",
                        "details": {"path": path, "reason": why,
                                    "refused": self.pins.refused}})

    def _register_request(self) -> protocol.RegisterRequest:
        roots = self.roots.registered()
        return {
            "run": self.cfg.run,
            "node": self.cfg.node,
            "hostname": hostname(),
            "pid": os.getpid(),
            "command": list(self.cfg.command),
            "nproc_per_node": self.cfg.nproc_per_node,
            "checkpoint_root": roots[0] if roots else None,
            "checkpoint_roots": roots,
            "agent_version": AGENT_VERSION,
            "spare": self.cfg.spare,
            "min_nodes": self.cfg.min_nodes,
            "address": self.cfg.advertise_addr,
            "devices": self.gpus.device_count(),
        }

    # -- executor host -----------------------------------------------------------------------

    @property
    def attempt(self) -> int:
        return self._attempt

    def set_state(self, to: AgentState) -> None:
        """Move to ``to``; a move ``AGENT_TRANSITIONS`` does not list is logged as an error
        and made all the same (the agent never stops on its own bookkeeping)."""
        if to == self.state:
            return
        if to not in AGENT_TRANSITIONS[self.state]:
            log.error("%s %s -> %s: not a move AGENT_TRANSITIONS lists", UNLISTED_MOVE,
                      self.state, to)
        self.state = to

    def begin_stop(self, *, immediate: bool = False) -> None:
        self.set_state(AgentState.STOPPING)
        self.launcher.begin_stop(immediate=immediate)

    def pin_checkpoint(self, path: str, reason: str) -> None:
        """Mark the checkpoint a restart resumes from so the workers' retention keeps it
        (``PINNED``, honoured by ``trainwarden.agent.worker.Checkpointer``); the pin this agent set
        for an
        earlier restart is lifted, so pins do not pile up."""
        if self.pins.set("restart", [path], reason):
            self._save_state()
        self._report_refused_pins()

    def _apply_protection(self) -> None:
        """Pin what the supervisor's latest reply says to protect (and only that).  A spare
        runs no workers, whose retention the pins are for: it pins nothing."""
        want = self.uplink.protect
        if want is None or self.role == NodeRole.SPARE:
            return  # no reply yet (or an older supervisor): leave the pins as they are
        if self.pins.set("protect", want, "protected by the supervisor (last good checkpoint "
                                          "or the target of a pending restart)"):
            self._save_state()
        self._report_refused_pins()

    def collect_stacks(self, reason: str, command_id: int | None) -> None:
        """Dump every worker's Python stacks and send them as a ``stacks`` event."""
        stacks = self.launcher.dump_stacks() if self.launcher.running else {}
        log.warning("collected the stacks of %d worker(s): %s", len(stacks), reason)
        self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                    "name": protocol.AgentEventName.STACKS,
                    "message": f"python stacks of {len(stacks)} worker(s): {reason}",
                    "details": {"stacks": {str(r): text for r, text in stacks.items()},
                                "reason": reason, "command_id": command_id}})

    def stopped(self) -> bool:
        return not self.launcher.stopping and not self.launcher.running

    def launch(self, attempt: int, plan_path: Path | None) -> None:
        # Persist first: an agent that dies now relaunches this attempt, not the old one.
        self._attempt, self.plan_path = attempt, plan_path
        self._save_state()
        self.exit_reported = False
        self.set_state(AgentState.STARTING)
        self.watch.new_attempt(attempt, self.clock())
        if self.membership is not None and self.role == NodeRole.MEMBER:
            self.launcher.command = rewrite(self.cfg.command, self.membership,
                                           rendezvous_timeout_s=self.cfg.rendezvous_timeout_s)
            # The workers spread each global batch over the ranks they are (fewer than
            # declared while the run is shrunk): they are told the declared world.
            world = declared_world_size(self.cfg.command, self.membership)
            if world is not None:
                self.launcher.worker_env[protocol.ENV_DECLARED_WORLD_SIZE] = str(world)
        self.launcher.start(attempt, plan_path)
        # When torchrun was started: a restart's anatomy splits "launch" from "rendezvous"
        # here (the workers' worker_started events mark the end of the rendezvous).
        self._emit({"type": "event", "t": self.clock(), "attempt": attempt,
                    "name": protocol.AgentEventName.TORCHRUN_STARTED,
                    "message": f"torchrun started for attempt {attempt}",
                    "details": {"pid": self.launcher.pid}})

    def finish(self, end: object) -> None:
        """A stop command ended the run (``end``: how, as the command says): the agent exits
        with that end's code once it has delivered what it spooled."""
        self.set_state(AgentState.STOPPED)
        self.result = exit_for(end)
        log.info("the run ended (%s): leaving with exit code %d", end or "stopped",
                 self.result)

    def _emit(self, item: dict[str, Any]) -> None:
        # (the rest of the rule for untrusted text is the supervisor's, where it enters)
        self.pending.append(untrusted.without_surrogates(item))
        if item.get("type") in _URGENT_TYPES:
            self.urgent = True

    # -- lifecycle ---------------------------------------------------------------------------

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

    def _identify(self) -> None:
        """Register before any worker starts: the reply names the run (its uuid and attempt)
        the local state must belong to.  A state of another run is archived here."""
        reply = self.uplink.register_now(self.cfg.register_wait_s)
        if self.uplink.refused:
            self._refused()
        elif reply is None:
            self._launched_unregistered = True
            log.warning("the supervisor did not accept the registration within %.0f s: "
                        "launching attempt %d from the local state (run uuid %s); it is "
                        "checked once the supervisor answers", self.cfg.register_wait_s,
                        self._attempt, self.run_uuid or "none yet")
        elif self.uplink.foreign is not None:
            self._archive_state(reply)
        else:
            self._adopt(reply, launching=True)
            self._learn_registration(reply)

    def _refused(self) -> None:
        log.error("%s", self.uplink.refused)
        self.result = EXIT_REFUSED

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

    def _check_registration(self) -> None:
        if self.uplink.refused and self.result is None:
            self._refused()  # shutdown() stops the workers
            return
        if self.uplink.foreign is not None:
            self._replace_foreign_state(self.uplink.foreign)
            return
        reg = self.uplink.registration
        if reg is not None and reg.get("run_uuid") not in (None, self.run_uuid):
            self._adopt(reg, launching=False)
        reg = self.uplink.registration
        if reg is None or self._registered_attempt_checked:
            return
        self._registered_attempt_checked = True
        if self._launched_unregistered:
            self._launched_unregistered = False
            self._learn_registration(reg)
            self._realign_membership()
        # Training was launched before registering (it never waits on the supervisor), so it
        # runs the attempt this node last knew; say so when the supervisor knows better.
        if reg.get("attempt") not in (None, self._attempt):
            log.warning("supervisor says the run is at attempt %s, local workers run attempt "
                        "%d: the supervisor's next restart command realigns them",
                        reg.get("attempt"), self._attempt)

    def _realign_membership(self) -> None:
        """A registration answered after torchrun was launched as written (the supervisor was
        away at the start): the other members run the static rendezvous of the membership
        the supervisor decided, and would wait on this node for ever.  Relaunch this node's
        workers as its node rank (the same attempt, from the newest checkpoint), or stop
        them when it is a spare."""
        if not (self.launcher.running or self.launcher.stopping) or self.executor.busy:
            return
        if self.role == NodeRole.MEMBER:
            if self.membership is None:
                return
            want = rewrite(self.cfg.command, self.membership,
                           rendezvous_timeout_s=self.cfg.rendezvous_timeout_s)
            if self.launcher.command == want:
                return
        log.warning("the supervisor answered after torchrun was launched as written: "
                    "relaunching attempt %d as %s", self._attempt,
                    f"node rank {self.membership.node_rank} of membership epoch "
                    f"{self.membership.epoch}" if self.membership is not None
                    and self.role == NodeRole.MEMBER else "a spare (nothing runs)")
        self.launcher.stop()
        self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                    "name": protocol.AgentEventName.MEMBERSHIP_REALIGNED,
                    "message": "relaunched for the membership the supervisor decided",
                    "details": {"role": self.role,
                                "node_rank": self.membership.node_rank
                                if self.membership is not None else None,
                                "epoch": self.membership.epoch
                                if self.membership is not None else None}})
        if self.role == NodeRole.MEMBER:
            self.launch(self._attempt, self.plan_path)
        else:
            self.exit_reported = True  # a spare's stop is no exit of the run's
            self.set_state(AgentState.SPARE)

    def _replace_foreign_state(self, reply: protocol.RegisterReply) -> None:
        """The supervisor answered only after the workers were launched from the local state,
        and that state is another run's: stop them, archive it, relaunch as the run's
        attempt on a fresh state (what they reported meanwhile is dropped)."""
        log.error("the workers were launched from the state of another run named %r "
                  "(uuid %s, not %s): stopping them to start afresh", self.cfg.run,
                  self.run_uuid or "none", reply.get("run_uuid"))
        self.launcher.stop()
        self.receiver.drain()
        self.receiver.take()
        self.pending = []
        self._archive_state(reply)
        self.launch(self._attempt, self.plan_path)
        if self.threaded_uplink:
            self.uplink.start()

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

"""What every part of the agent shares: its state dir (locked, its files read and saved), its
state and the moves it makes (``AGENT_TRANSITIONS``), what it spools, and launching torchrun."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import random
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx

from trainwarden.agent import protocol
from trainwarden.agent.config import AgentConfig
from trainwarden.agent.core import text as untrusted
from trainwarden.agent.core.launch import Membership, declared_world_size, rewrite
from trainwarden.agent.core.states import AGENT_TRANSITIONS, AgentExit, AgentState, NodeRole
from trainwarden.agent.executor import Executor, Host
from trainwarden.agent.launcher import Launcher, PopenFactory
from trainwarden.agent.monitor import DatagramReceiver, GpuHealth, WorkerStats, hostname
from trainwarden.agent.pins import CheckpointPins
from trainwarden.agent.roots import CheckpointRoots
from trainwarden.agent.statefile import load_json, save_json
from trainwarden.agent.uplink import Uplink
from trainwarden.agent.version import version
from trainwarden.agent.watchdog import HangWatch

log = logging.getLogger("trainwarden.agent.loop")


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


class AgentBase:
    """The agent's state and what each of its parts uses."""

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
        # (the executor's host is the whole Agent, whose parts together are a ``Host``)
        self.executor = Executor(self.state_dir, cast(Host, self), self._emit, clock)
        pins = saved.get("pins")
        # (an agent of an earlier version saved its restart pins as a plain list)
        self.pins = CheckpointPins({"restart": pins} if isinstance(pins, list) else pins,
                                   roots=self.roots.pin_roots())

    def _is_our_run(self, reply: protocol.RegisterReply) -> bool:
        """Whether the local state belongs to the run the supervisor answered for: the same
        uuid, or a fresh state dir (an older supervisor sends no uuid: the state is kept)."""
        uuid = reply.get("run_uuid")
        return not uuid or uuid == self.run_uuid or (self.run_uuid is None and self._unbound)

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
            "scheduler_job": os.environ.get("SLURM_JOB_ID", ""),
        }

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

    def _emit(self, item: dict[str, Any]) -> None:
        # (the rest of the rule for untrusted text is the supervisor's, where it enters)
        self.pending.append(untrusted.without_surrogates(item))
        if item.get("type") in _URGENT_TYPES:
            self.urgent = True

    def _refused(self) -> None:
        log.error("%s", self.uplink.refused)
        self.result = EXIT_REFUSED

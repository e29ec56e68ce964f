"""Agent configuration: one dataclass, validated as a whole.

Cross-field rules raise ``ValueError`` with a message that says how to fix the command line,
because the person reading it is starting a multi-day run and wants the fix, not a trace.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from trainwarden.agent import deadletter, protocol, uplink
from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.agent.core.hang import HangConfig
from trainwarden.agent.core.launch import (
    RENDEZVOUS_TIMEOUT_S,
    min_nodes_refused,
    unrewritable,
)
from trainwarden.agent.core.names import RUN_NAME_MAX, RUN_NAME_RULE, is_run_name, supervisor_urls

ENV_AGENT_TOKEN = "TRAINWARDEN_AGENT_TOKEN"

# Unix socket paths are limited to 108 bytes (sun_path) on Linux; keep a margin.
_MAX_SOCKET_PATH = 100


def default_state_dir(run: str, node: str) -> Path:
    """Per run name and node, so two agents on one host (two runs) never share a spool.  The
    state in it belongs to the supervisor's identity of the run (its uuid), not to the name:
    an agent that finds another run's state there archives it before any worker starts."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "trainwarden" / _safe(run) / _safe(node)


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "_"


@dataclass
class AgentConfig:
    # One URL, or the comma-separated URLs of a supervisor's replicas (failed over in order)
    supervisor_url: str
    run: str
    command: list[str]
    node: str = field(default_factory=socket.gethostname)
    token: str | None = None
    state_dir: Path | None = None  # None: default_state_dir(run, node)
    checkpoint_root: Path | None = None
    # Seconds between a group SIGTERM and the group SIGKILL on stop.
    stop_grace_s: float = bounded(5.0, ge=0)
    # Upper bound between two batches (each carries a heartbeat).
    batch_interval_s: float = bounded(1.0, gt=0)
    # Main loop period: how often the socket is drained and torchrun polled.
    tick_interval_s: float = bounded(0.1, gt=0)
    http_timeout_s: float = uplink.HTTP_TIMEOUT_S
    # Before launching, how long to try registering: the reply says which run this is (its
    # uuid and attempt), so the workers never start from another run's state.  A supervisor
    # that does not answer in time delays training by this much at most.
    register_wait_s: float = bounded(10.0, ge=0)
    # Spool bound (undelivered batches on disk); the oldest go first when it is full.
    spool_max_bytes: int = bounded(uplink.SPOOL_MAX_BYTES, gt=0)
    spool_max_batches: int = bounded(uplink.SPOOL_MAX_BATCHES, gt=0)
    # Batches the supervisor refused, kept for a human (``dead-letter/`` in the state dir).
    dead_letter_max_bytes: int = bounded(deadletter.MAX_BYTES, gt=0)
    dead_letter_max_batches: int = bounded(deadletter.MAX_BATCHES, gt=0)
    # 5xx answers in a row before a batch steps out of line for the newer ones.
    max_5xx_tries: int = bounded(uplink.MAX_5XX_TRIES, ge=1)
    # Items per batch: a burst of step reports is split so no request grows unbounded.
    max_items_per_batch: int = bounded(uplink.MAX_ITEMS_PER_BATCH, gt=0)
    # In-memory queue of worker datagrams between two ticks.
    queue_max: int = bounded(100_000, gt=0)
    # On exit (completed / stopped), how long to try delivering what is left in the spool.
    flush_timeout_s: float = 10.0
    # The local hang watchdog (acts only while the supervisor is unreachable): the same
    # statistic and defaults as the supervisor's hang detector.
    hang: HangConfig = field(default_factory=HangConfig)
    # GPU health (NVML) is read at most this often; heartbeats in between carry none.
    gpu_interval_s: float = bounded(5.0, gt=0)
    # A spare: registers and heartbeats, runs nothing until the supervisor gives it the node
    # rank of a lost or cordoned member (then it launches the command as that rank).
    spare: bool = False
    # The smallest world the run accepts: without a free spare, a lost or cordoned member's
    # run goes on with the other members (the same global batch, each rank accumulating
    # more micro-batches) down to this many nodes, and grows back at a checkpoint once a
    # node is free.  None: the declared world (wait for a node).  Give every agent of the
    # run the same value.
    min_nodes: int | None = None
    # Where this node's torchrun can host the rendezvous, as the other nodes reach it (host
    # name or IP); empty: the address the supervisor sees this agent's requests come from.
    advertise_addr: str = ""
    # How long a node's torchrun waits for the run's rendezvous to form (seconds): a member
    # that cannot reach the rank-0 host fails after it, naming the host (a partition).
    rendezvous_timeout_s: int = bounded(RENDEZVOUS_TIMEOUT_S, ge=1, hint="the default is 120")
    # Each worker's preflight health check after its process group starts, before its first
    # step (trainwarden.agent.worker.preflight: its device, a checked matmul, a timed
    # all-reduce across the new gang); a worker that fails it exits before training.
    # Measured: about 0.03 s per worker (at most 0.05 s) with 2 gloo workers on a 2-core CPU
    # machine (benchmarks/results/2026-12-05-preflight.md).  False: not run.
    preflight: bool = True
    # The preflight's bound on its all-reduce (seconds); with the local checks' milliseconds
    # the default keeps the whole check under 5 s.  Raise it for a large NCCL job, whose
    # first collective sets up the communicator.
    preflight_timeout_s: float = bounded(protocol.PREFLIGHT_TIMEOUT_S, gt=0, finite=True,
                                         hint="the default is 4")

    def __post_init__(self) -> None:
        # The supervisor's rules (trainwarden.agent.core.names), checked here so a bad address or
        # name
        # fails at once instead of as a registration refused forever.
        self.supervisor_url = ",".join(supervisor_urls(self.supervisor_url))
        if not is_run_name(self.run):
            raise ValueError(
                f"--run {self.run!r}: use {RUN_NAME_RULE}, at most {RUN_NAME_MAX} characters "
                "(for example --run llama-7b)"
            )
        if not self.node.strip():
            raise ValueError("--node must not be empty (it defaults to the host name)")
        if not self.command:
            raise ValueError(
                "no command to run: put the torchrun command after '--', for example "
                "trainwarden agent --supervisor URL --run NAME -- torchrun "
                "--nproc_per_node=2 train.py"
            )
        # The supervisor decides each attempt's members and rewrites the torchrun command
        # for them: a command that cannot be rewritten fails here, with the fix (the
        # supervisor refuses it at registration too).
        why = unrewritable(self.command) or min_nodes_refused(self.min_nodes, self.command)
        if why is not None:
            raise ValueError(why)
        check(self)
        cross_check(self.tick_interval_s <= self.batch_interval_s, self, "tick_interval_s",
                    f"<= batch_interval_s = {self.batch_interval_s:g}",
                    got=self.tick_interval_s)
        if self.state_dir is None:
            self.state_dir = default_state_dir(self.run, self.node)
        self.state_dir = Path(self.state_dir).expanduser().absolute()
        if self.checkpoint_root is not None:
            self.checkpoint_root = Path(self.checkpoint_root).expanduser().absolute()

    @property
    def state(self) -> Path:
        """The state directory (set by ``__post_init__``; typed non-optional for callers)."""
        assert self.state_dir is not None
        return self.state_dir

    @property
    def worker_env(self) -> dict[str, str]:
        """What this config sets in the workers' environment (over the agent's own)."""
        return {protocol.ENV_PREFLIGHT: "1" if self.preflight else "0",
                protocol.ENV_PREFLIGHT_TIMEOUT: repr(float(self.preflight_timeout_s))}

    @property
    def socket_path(self) -> Path:
        """Where the workers send datagrams.  Deterministic per state dir, so a restarted agent
        binds the same path and recognises its predecessor's workers by it."""
        path = self.state / "agent.sock"
        if len(str(path)) <= _MAX_SOCKET_PATH:
            return path
        digest = hashlib.sha1(str(self.state).encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"trainwarden-{digest}.sock"

    @property
    def command_checkpoint_dir(self) -> Path | None:
        """The training command's ``--checkpoint-dir DIR`` (or ``--checkpoint_dir``), made
        absolute against this directory (torchrun and its workers run here): the checkpoint
        root the agent registers when no --checkpoint-root is given."""
        cmd = self.command
        for i, arg in enumerate(cmd):
            for flag in ("--checkpoint-dir", "--checkpoint_dir"):
                value: str | None = None
                if arg == flag and i + 1 < len(cmd):
                    value = cmd[i + 1]
                elif arg.startswith(flag + "="):
                    value = arg.split("=", 1)[1]
                if value:
                    return Path(value).expanduser().absolute()
        return None

    @property
    def nproc_per_node(self) -> int | None:
        """Read from the torchrun command when it says (for registration only)."""
        cmd = self.command
        for i, arg in enumerate(cmd):
            for flag in ("--nproc_per_node", "--nproc-per-node"):
                value: str | None = None
                if arg == flag and i + 1 < len(cmd):
                    value = cmd[i + 1]
                elif arg.startswith(flag + "="):
                    value = arg.split("=", 1)[1]
                if value is not None:
                    try:
                        n = int(value)
                    except ValueError:
                        return None  # "gpu", "auto": not a number the supervisor can use
                    return n if n >= 1 else None
        return None

"""Wire types shared by the training workers, the node agent and the supervisor.

Standard library only: the in-training library imports this module, and it must stay cheap and
free of the supervisor's dependencies.

Three hops, one vocabulary:

1. worker -> agent: JSON objects on a local Unix datagram socket whose path the agent passes
   in ``TRAINWARDEN_AGENT_SOCKET``; a datagram holds one or more objects, one per line (a
   worker batches the reports of several steps into one send).  Messages are ``StepReport``,
   ``WorkerEvent`` and ``CheckpointReport`` (the ``type`` field tells which).  A send never
   blocks: when the agent is absent or its queue is full the message is dropped and counted.
2. agent -> supervisor: ``POST /api/v1/ingest`` with an ``IngestBatch`` holding the worker
   messages plus agent items (``heartbeat``, ``exit``, ``command_result``).  Batches carry a
   per-agent sequence number so a replayed batch is stored once.
3. supervisor -> agent: the ingest reply carries pending ``Command`` objects and the
   checkpoints to protect from retention.  A ``restart``
   command carries a ``ResumePlan`` that the agent writes to a JSON file and names in
   ``TRAINWARDEN_RESUME_PLAN`` for the next torchrun attempt.

Floats that are not finite (a NaN loss) are sent as the JSON tokens ``NaN``/``Infinity`` that
Python's ``json`` reads and writes; receivers must keep them (a NaN loss is the signal).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any, Literal, NotRequired, TypedDict

from trainwarden.agent.core.rootcause import RootCauseSource
from trainwarden.agent.core.states import (
    AgentState,
    CommandKind,
    CommandStatus,
    ExitOutcome,
    NodeRole,
    RunEnd,
)

PROTOCOL_VERSION = 1

# Environment variables the agent sets for the workers it launches.
ENV_AGENT_SOCKET = "TRAINWARDEN_AGENT_SOCKET"
ENV_RESUME_PLAN = "TRAINWARDEN_RESUME_PLAN"
ENV_ATTEMPT = "TRAINWARDEN_ATTEMPT"
ENV_RUN = "TRAINWARDEN_RUN"
ENV_NODE = "TRAINWARDEN_NODE"
# The preflight health check each worker runs before its first step
# (``trainwarden.agent.worker.preflight``): "0" turns it off; the bound on its all-reduce.
ENV_PREFLIGHT = "TRAINWARDEN_PREFLIGHT"
ENV_PREFLIGHT_TIMEOUT = "TRAINWARDEN_PREFLIGHT_TIMEOUT_S"
# The ranks of the run's declared world (its global batch is defined on them), set by the
# agent for every launch of a multi-node run; WORLD_SIZE is fewer while the run is shrunk.
ENV_DECLARED_WORLD_SIZE = "TRAINWARDEN_DECLARED_WORLD_SIZE"
# The preflight's default bound (seconds), here so that the agent's config needs no torch.  It
# bounds the wait on the all-reduce, so that with the local checks' few milliseconds the whole
# check stays under 5 s.
PREFLIGHT_TIMEOUT_S = 4.0

# A checkpoint directory holding this file is never deleted by the workers' retention.
PIN_FILE = "PINNED"

# A datagram larger than this is refused by the sender (and counted as dropped).
MAX_DATAGRAM_BYTES = 60_000


class StepReport(TypedDict, total=False):
    """One optimiser step on one rank. ``step`` is 0-based: the index of the step just trained."""

    type: Literal["step"]
    v: int
    attempt: int  # the run attempt (TRAINWARDEN_ATTEMPT), 0 for the first
    rank: int
    local_rank: int
    world_size: int
    pid: int
    step: int
    t: float  # unix time at the end of the step
    batch_index: int | None  # global index of the batch trained at this step
    loss: float | None
    samples: int | None
    tokens: int | None
    lr: float | None
    grad_norm: float | None
    data_s: float | None  # waiting for the batch
    compute_s: float | None  # compute before the first blocking collective
    step_s: float | None  # the whole step, wall time
    dropped: int  # reports this rank dropped before this one (agent absent, queue full)


class WorkerEventName(StrEnum):
    """Names of the events the training workers send.  Free-form names are allowed; these
    are the ones the system acts on."""

    STARTED = "worker_started"
    COLLECTIVE_TIMEOUT = "collective_timeout"
    DISTRIBUTED_ERROR = "distributed_error"
    EXCEPTION = "worker_exception"
    RESUMED = "resumed"
    BATCHES_SKIPPED = "batches_skipped"
    CHECKPOINT_SKIPPED = "checkpoint_skipped"  # an incomplete checkpoint passed over on resume
    CHECKPOINT_FAILED = "checkpoint_failed"
    # The training loop is over (``trainwarden.agent.worker.training_done``, called by
    # Checkpointer.close()): what follows is teardown, judged against the hang detectors'
    # finishing allowance.
    FINISHED = "worker_finished"
    CHECKPOINT_STARTED = "checkpoint_started"  # a save began (hang deadlines allow for it)
    # details: {peak_flops_per_rank, flops_per_sample | flops_per_token} (for MFU)
    FLOPS_DECLARED = "flops_declared"
    # A fault the test harness injected fired (``trainwarden.agent.worker.faults``).
    FAULT_INJECTED = "fault_injected"
    # The preflight health check ran (``trainwarden.agent.worker.preflight``), once per
    # worker process, before its first step; details: {passed, checks: [{name, passed,
    # seconds, detail}], seconds, failed (one line, or null), node, hostname}.  A failed one
    # is followed by the worker's exit (PreflightFailed).  Turned off, it is still sent
    # (details {passed: null, skipped: true}): it marks the end of the restart's preflight
    # phase.
    PREFLIGHT = "preflight"
    # The data-parallel replicas' exact parameter fingerprints disagree
    # (``trainwarden.agent.worker.fingerprint``): silent data corruption.  Details: step,
    # ranks, fingerprints, corrupt (the minority's ranks, with three replicas or more),
    # suspects (every rank, when no majority can say), last_agreed_step, first_disagreement.
    REPLICA_MISMATCH = "replica_mismatch"


class AgentEventName(StrEnum):
    """Names of the events the node agent sends."""

    STACKS = "stacks"  # details: {"stacks": {rank: text}, "reason", "command_id"}
    LOCAL_HANG = "hang_detected_locally"  # the agent's watchdog acted, supervisor away
    # A batch the supervisor refused (4xx) or kept failing on (5xx) was set aside by the
    # agent; details: {seq, status, reason, items, count (set aside so far), dropped, path}
    BATCH_DEAD_LETTERED = "batch_dead_lettered"
    # The agent refused to pin a checkpoint path outside this node's checkpoint root(s);
    # details: {path, reason}
    PIN_REFUSED = "checkpoint_pin_refused"
    # The agent found another run's state in its state dir (a reused run name) and archived
    # it before starting any worker; details: {"archived_to", "old_run_uuid"}.
    STATE_ARCHIVED = "agent_state_archived"
    # The agent started torchrun for an attempt (its first start, a restart, a relaunch
    # after an agent restart); details: {"pid"}.  Marks the end of a restart's launch phase.
    TORCHRUN_STARTED = "torchrun_started"
    # At its start the agent killed the workers an earlier agent of this node left running.
    LEFTOVERS_KILLED = "agent_leftovers_killed"
    # A restart command found this node not to run (not a member, or a member waiting for a
    # missing node); details: {"role"}.
    STANDING_BY = "standing_by"
    # A reply said this node is no longer a member (replaced while silent): its workers were
    # killed; details: {"epoch", "workers_killed"}.
    NOT_A_MEMBER = "not_a_member"
    # The agent found it had not run for longer than the node-lost deadline (stopped,
    # frozen) and killed its workers; details: {"gap_s", "node_lost_s"}.
    WOKE_UP = "agent_woke_up"
    # The supervisor answered only after torchrun was launched as written (it was away at the
    # start), and its membership asks for another command (the static rendezvous of this
    # node's rank, or nothing for a spare): the workers were relaunched as it says;
    # details: {"role", "node_rank", "epoch"}.
    MEMBERSHIP_REALIGNED = "membership_realigned"


# The name ``trainwarden.agent.uplink`` uses (kept for it).
EVENT_BATCH_DEAD_LETTERED = AgentEventName.BATCH_DEAD_LETTERED


class WorkerEvent(TypedDict, total=False):
    type: Literal["event"]
    v: int
    attempt: int
    rank: int
    local_rank: int
    pid: int
    t: float
    name: str
    step: int | None
    message: str
    details: dict[str, Any]


class CheckpointReport(TypedDict, total=False):
    """Sent by rank 0 once a checkpoint is complete on disk (validated)."""

    type: Literal["checkpoint"]
    v: int
    attempt: int
    rank: int
    t: float
    step: int  # steps done: resuming from it continues at this step index
    path: str
    bytes: int
    save_s: float  # from the save call to complete
    async_save: bool
    stall_s: float  # how long the save call blocked the training loop (staging, for async)
    lineage: str  # id of the chain of attempts that wrote it (see ResumePlan.lineage)
    # trainwarden.agent.worker reports a checkpoint once it is complete and leaves this out (true);
    # a
    # reporter may send false for one it knows to be incomplete (never offered for a resume).
    complete: bool


WorkerMessage = StepReport | WorkerEvent | CheckpointReport


def encode_datagram(message: WorkerMessage | Mapping[str, Any]) -> bytes:
    """Compact JSON, one message per datagram."""
    return json.dumps(message, separators=(",", ":")).encode()


def decode_datagram(data: bytes | str) -> dict[str, Any]:
    """Parse one message; raises ``ValueError`` with the reason when it is not a message."""
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"not a JSON datagram: {e}") from None
    if not isinstance(obj, dict) or obj.get("type") not in ("step", "event", "checkpoint"):
        raise ValueError("datagram is not a step, event or checkpoint message")
    return obj


def decode_datagrams(data: bytes) -> tuple[list[dict[str, Any]], list[str]]:
    """Parse a datagram of one or more messages, one per line: (messages, errors)."""
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            out.append(decode_datagram(line))
        except ValueError as e:
            errors.append(str(e))
    if not out and not errors:
        errors.append("empty datagram")
    return out, errors


# ---------------------------------------------------------------------------------------------
# Resume plans: written by the agent, read by the in-training library at start-up.


@dataclass(frozen=True)
class LRSchedule:
    """Multiply the LR by ``scale`` for ``steps`` steps, then ramp back linearly over
    ``ramp_steps`` steps, all counted from ``start_step`` (the first step index trained after
    the resume).

    For step index ``s`` and ``j = s - start_step``:
    ``j < steps`` -> ``scale``; ``steps <= j < steps + ramp_steps`` ->
    ``scale + (1 - scale) * (j - steps + 1) / ramp_steps`` (the last ramp step is back at 1.0);
    afterwards (and before ``start_step``) -> 1.0.
    """

    scale: float
    steps: int
    ramp_steps: int = 0
    start_step: int | None = None  # filled in when the plan is applied

    def __post_init__(self) -> None:
        if not (0.0 < self.scale <= 10.0) or not math.isfinite(self.scale):
            raise ValueError(f"lr scale must be in (0, 10], got {self.scale}")
        if self.steps < 0 or self.ramp_steps < 0:
            raise ValueError("lr steps and ramp_steps must be >= 0")

    def factor(self, step: int) -> float:
        if self.start_step is None:
            raise ValueError("LRSchedule.start_step is not set: apply the plan first")
        j = step - self.start_step
        if j < 0:
            return 1.0
        if j < self.steps:
            return self.scale
        j -= self.steps
        if j < self.ramp_steps:
            return self.scale + (1.0 - self.scale) * (j + 1) / self.ramp_steps
        return 1.0

    def end_step(self) -> int:
        """First step index at which the factor is back to 1.0 for good."""
        assert self.start_step is not None
        return self.start_step + self.steps + self.ramp_steps


def normalize_ranges(ranges: Any) -> list[tuple[int, int]]:
    """Validate inclusive batch-index ranges ``[[a, b], ...]`` and merge overlaps.

    Raises ``ValueError`` naming the bad range."""
    if ranges is None:
        return []
    if not isinstance(ranges, list | tuple):
        raise ValueError("skip must be a list of [from, to] batch-index ranges")
    out: list[tuple[int, int]] = []
    for r in ranges:
        if (
            not isinstance(r, list | tuple)
            or len(r) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in r)
        ):
            raise ValueError(f"skip range {r!r} must be two integers [from, to]")
        a, b = int(r[0]), int(r[1])
        if a < 0 or b < a:
            raise ValueError(f"skip range [{a}, {b}] must satisfy 0 <= from <= to")
        out.append((a, b))
    out.sort()
    merged: list[tuple[int, int]] = []
    for a, b in out:
        if merged and a <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


@dataclass(frozen=True)
class ResumePlan:
    """What the next attempt of a run should do when it starts.

    JSON form (the file named by ``TRAINWARDEN_RESUME_PLAN``)::

        {"version": 1,
         "checkpoint": "/ckpt/step_400" | null,   # null: the newest complete checkpoint
         "skip": [[1200, 1499]],                  # inclusive global batch-index ranges
         "lr": {"scale": 0.5, "steps": 200, "ramp_steps": 100} | null,
         "attempt": 3, "lineage": "a3", "reason": "loss spike at step 1234",
         "action_id": 17}
    """

    checkpoint: str | None = None
    skip: tuple[tuple[int, int], ...] = ()
    lr: LRSchedule | None = None
    attempt: int | None = None
    lineage: str | None = None
    reason: str = ""
    action_id: int | None = None
    # The attempt's membership, as the supervisor decided it (the agent's, not the
    # workers'): {"epoch", "nnodes" (the attempt's world), "declared" (the run's declared
    # world), "endpoint", "members": {node: node rank}, "waiting": [node ranks whose node is
    # missing]}.  A node not among the members stands by as a spare;
    # while a rank waits, every member stands by.
    membership: dict[str, Any] | None = None
    version: int = PROTOCOL_VERSION

    def to_json(self) -> str:
        d = asdict(self)
        d["skip"] = [list(r) for r in self.skip]
        if self.lr is not None:
            d["lr"] = {"scale": self.lr.scale, "steps": self.lr.steps,
                       "ramp_steps": self.lr.ramp_steps}
        return json.dumps(d, indent=1)

    @classmethod
    def from_dict(cls, d: Any) -> ResumePlan:
        if not isinstance(d, dict):
            raise ValueError("resume plan must be a JSON object")
        unknown = set(d) - {f.name for f in _fields(cls)}
        if unknown:
            raise ValueError(f"resume plan has unknown fields: {sorted(unknown)}")
        if d.get("version", PROTOCOL_VERSION) != PROTOCOL_VERSION:
            raise ValueError(f"resume plan version {d.get('version')} is not {PROTOCOL_VERSION}")
        lr = d.get("lr")
        sched = None
        if lr is not None:
            if not isinstance(lr, dict) or not {"scale", "steps"} <= set(lr):
                raise ValueError('resume plan "lr" needs "scale" and "steps"')
            sched = LRSchedule(scale=float(lr["scale"]), steps=int(lr["steps"]),
                               ramp_steps=int(lr.get("ramp_steps", 0)))
        ckpt = d.get("checkpoint")
        if ckpt is not None and not isinstance(ckpt, str):
            raise ValueError('resume plan "checkpoint" must be a path or null')
        return cls(
            checkpoint=ckpt,
            skip=tuple(normalize_ranges(d.get("skip"))),
            lr=sched,
            attempt=d.get("attempt"),
            lineage=d.get("lineage"),
            reason=str(d.get("reason", "")),
            action_id=d.get("action_id"),
            membership=d.get("membership") if isinstance(d.get("membership"), dict) else None,
        )

    @classmethod
    def from_json(cls, text: str) -> ResumePlan:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"resume plan is not JSON: {e}") from None
        return cls.from_dict(d)


def _fields(cls: type) -> tuple[Any, ...]:
    return dataclasses.fields(cls)


# ---------------------------------------------------------------------------------------------
# Agent <-> supervisor (HTTP, JSON).  The supervisor validates these shapes with pydantic.


CREDENTIAL_HEADER = "X-Trainwarden-Agent-Credential"


class RegisterRequest(TypedDict, total=False):
    run: str
    node: str
    hostname: str
    pid: int
    command: list[str]
    nproc_per_node: int | None
    checkpoint_root: str | None  # the first of checkpoint_roots (what older supervisors read)
    # Where this node's checkpoints are saved: the supervisor refuses a checkpoint reported
    # anywhere else (absolute directories, not "/").
    checkpoint_roots: list[str]
    agent_version: str
    takeover: bool
    spare: bool  # runs nothing until the supervisor gives it a node rank
    address: str  # where its torchrun can host the rendezvous ("": as the supervisor sees it)
    devices: int | None  # GPUs on this node
    # The smallest world the run accepts (``--min-nodes``; None: the declared one).
    min_nodes: int | None
    scheduler_job: str  # the scheduler's job the agent runs in (Slurm: $SLURM_JOB_ID); ""


class MembershipView(TypedDict):
    """What the node is in the run (the registration reply's ``membership``)."""

    role: NodeRole
    node_rank: int | None
    nnodes: int | None  # the attempt's world (fewer than ``declared`` after a shrink)
    epoch: int
    endpoint: str | None  # HOST:PORT of the static rendezvous; None: stand by
    declared: NotRequired[int | None]  # the declared world (an older supervisor: absent)


class RegisterReply(TypedDict):
    agent_id: int
    run_id: int
    # The supervisor's identity of the run (an older supervisor sends none): the agent's
    # local state belongs to it, and a state saved under another is archived.
    run_uuid: str
    attempt: int  # the run's current attempt; the agent launches with it
    next_seq: int  # first sequence number the supervisor has not stored for this agent
    heartbeat_interval_s: float
    # The agent's secret (an older supervisor sends none): sent with every ingest and
    # registration in CREDENTIAL_HEADER; kept in the state dir.
    credential: str
    membership: NotRequired[MembershipView]  # (an older supervisor sends none)
    # A node silent this long is lost (an older supervisor sends none).
    node_lost_s: NotRequired[float]


class HeartbeatItem(TypedDict, total=False):
    type: Literal["heartbeat"]
    t: float
    attempt: int
    state: AgentState
    workers: list[dict[str, Any]]  # {rank, local_rank, pid, cpu_percent, rss_bytes}
    disk_free_bytes: int | None  # of the checkpoint root's file system
    disk_total_bytes: int | None
    # NVML readings, every few heartbeats: {"available": true, "devices": [{index, name,
    # util_percent, mem_used_bytes, mem_total_bytes, temp_c, power_w, ecc_uncorrected,
    # and where NVML delivers XID events: xid_errors (hardware XIDs since the agent
    # started), xid_last}]} or {"available": false, "reason": "..."}; absent when not read
    # this time.
    gpus: dict[str, Any]


class RootFrame(TypedDict):
    """A traceback frame (``trainwarden.agent.core.rootcause.Frame``)."""

    file: str
    line: int
    function: str


class RootCause(TypedDict, total=False):
    """Why a rank failed, as the agent read it from what the worker left
    (``trainwarden.agent.core.rootcause.RootCause.as_dict``)."""

    exc_type: str
    message: str
    frame: RootFrame | None  # the innermost frame
    user_frame: RootFrame | None  # the innermost frame of the user's code
    traceback: str  # its last lines
    source: RootCauseSource | None
    rank: int | None
    host: str | None


class FailedRank(TypedDict, total=False):
    """One failed worker of an exit, as torchrun's error summary names it (the supervisor
    keeps further keys as they are)."""

    rank: int | None
    local_rank: int | None
    exit_code: int | None
    signal: int | None
    pid: int | None
    message: str | None  # the worker's own last words, from its stderr
    root_cause: RootCause | None
    launcher: bool | None  # torchrun itself failed before any worker did (rank is None)


class ExitItem(TypedDict, total=False):
    """torchrun (the local worker group) ended."""

    type: Literal["exit"]
    t: float
    attempt: int
    exit_code: int | None
    signal: int | None
    outcome: ExitOutcome
    failed_ranks: list[FailedRank]


class CommandResultItem(TypedDict, total=False):
    type: Literal["command_result"]
    t: float
    command_id: int
    status: CommandStatus  # one of COMMAND_RESULTS: delivered, done, failed
    detail: str


class IngestBatch(TypedDict, total=False):
    agent_id: int
    seq: int
    sent_at: float
    attempt: int
    dropped: int  # items the agent dropped (spool full), cumulative
    items: list[dict[str, Any]]


COMMAND_RESTART = CommandKind.RESTART
COMMAND_STOP = CommandKind.STOP


class Command(TypedDict, total=False):
    id: int
    kind: CommandKind
    attempt: int  # for restart: the attempt number the new torchrun runs as
    # restart: the ResumePlan as a dict; stop: a ``StopPlan``
    plan: dict[str, Any] | None
    not_before: float | None  # unix time: backoff before relaunching
    reason: str
    # A hang: dump every worker's Python stacks (sent back as a "stacks" event), then SIGKILL
    # the whole tree at once instead of SIGTERM and a grace period.
    collect_stacks: bool


class StopPlan(TypedDict, total=False):
    """What a stop command says besides stopping: every stop ends the run (the agent exits
    with the code of ``run_status``: ``AgentExit``)."""

    run_status: RunEnd  # how the run ended


class IngestReply(TypedDict, total=False):
    seq: int
    duplicate: bool
    attempt: int
    commands: list[Command]
    # Checkpoint paths the workers' retention must keep: the last good one before an open
    # incident, the target of a pending restart.  The agent pins exactly these (and the
    # target of the restart it applies); an older supervisor sends none.
    protect: list[str]
    # While the supervisor is behind (and a while after): send a batch this often at most
    # (seconds); absent: our own interval.
    batch_interval_s: float
    role: NodeRole  # what the node is in the run now (an older supervisor sends none)
    epoch: int  # the membership epoch

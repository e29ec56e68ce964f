"""Pydantic models mirroring ``agent/protocol.py`` (the agent <-> supervisor HTTP shapes).

The protocol's TypedDicts are the wire's definition (standard library only: the agent and the
in-training library import them); these models add what only the supervisor needs, the
bounds and the cleaning of untrusted text.  ``tests/supervisor/contract/test_sup_wire.py``
pairs every model here with its TypedDict and fails on any field or type that differs.

The supervisor validates every request against these before anything is stored.  Unknown
fields are ignored (a newer agent may send more), unknown item types are refused (the batch
would otherwise be half understood).  Every number and text field is bounded by
``trainwarden.supervisor.contract.limits`` (what both stores hold; the OpenAPI documents the
bounds): durations must be finite; an agent's times may be any number (ingest checks them
against its own clock); loss and grad norm keep NaN/Infinity (a NaN loss is a signal).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator

from trainwarden.agent.core import text as untrusted
from trainwarden.agent.core.names import RUN_NAME_MAX, RUN_NAME_PATTERN
from trainwarden.agent.core.rootcause import RootCauseSource
from trainwarden.agent.core.states import CommandKind, ExitOutcome, NodeRole
from trainwarden.supervisor.contract import checkpoint_paths
from trainwarden.supervisor.contract.limits import (
    I32,
    MAX_PATH,
    U31,
    U63,
    AgentJSON,
    AgentText,
    AgentTime,
    Arg,
    Finite,
    Line,
    Positive31,
    line,
)

# A JSON list an item carries as it is (the store keeps what it understands of it).
_MAX_LIST = 4096


class _Wire(BaseModel):
    # ser_json_inf_nan: the content digest tells a NaN loss from a missing one.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=True, ser_json_inf_nan="constants")


class RegisterRequest(_Wire):
    run: str = Field(min_length=1, max_length=RUN_NAME_MAX, pattern=RUN_NAME_PATTERN)
    node: Line = line(min_length=1, max_length=200)
    hostname: Line = line("", max_length=255)
    pid: U31 | None = None
    command: list[Arg] = Field(default_factory=list, max_length=1000)
    nproc_per_node: Positive31 | None = None
    # (one root, as the first agents sent it; it joins checkpoint_roots, first)
    checkpoint_root: Line | None = line(None, max_length=MAX_PATH)
    checkpoint_roots: list[Annotated[str, Field(max_length=checkpoint_paths.MAX_PATH)]] = Field(
        default_factory=list, max_length=checkpoint_paths.MAX_ROOTS,
        description="the directories this agent's checkpoints are saved in (absolute, not "
                    "'/'): every checkpoint path it reports must lie strictly inside one, "
                    "and a relative one is resolved against the first")
    agent_version: Line = line("", max_length=50)
    # Replace the (run, node)'s live agent (its credential is revoked): the operator token
    # only, an audited action.
    takeover: bool = False
    # A spare: registers, heartbeats and runs nothing until the supervisor gives it the node
    # rank of a lost or cordoned member.
    spare: bool = False
    # Where this node's torchrun can host the rendezvous, as the other nodes reach it (a host
    # name or an IP address); empty: the address the registration came from.
    address: Line = line("", max_length=255)
    devices: U31 | None = None  # GPUs this node has (its capacity, with nproc_per_node)
    # The smallest world the run accepts (agent --min-nodes): without a free spare, a lost
    # or cordoned member's run goes on with the other members, down to this many nodes.
    # None: the declared world (wait for a node).
    min_nodes: Positive31 | None = None
    # The scheduler's job this agent runs in (Slurm: $SLURM_JOB_ID); "": none.  The job a
    # supervisor with ``fleet.requeue`` puts back in the queue.
    scheduler_job: Line = line("", max_length=100)

    @field_validator("checkpoint_root")
    @classmethod
    def _root(cls, v: str | None) -> str | None:
        return None if v is None else checkpoint_paths.normalize_root(v)

    @field_validator("checkpoint_roots")
    @classmethod
    def _roots(cls, v: list[str]) -> list[str]:
        return checkpoint_paths.normalize_roots(v)

    @model_validator(mode="after")
    def _all_roots(self) -> RegisterRequest:
        roots = checkpoint_paths.normalize_roots(
            [*([self.checkpoint_root] if self.checkpoint_root else []), *self.checkpoint_roots])
        if len(roots) > checkpoint_paths.MAX_ROOTS:
            raise ValueError(f"at most {checkpoint_paths.MAX_ROOTS} checkpoint roots")
        self.checkpoint_roots = roots
        return self


class MembershipOut(BaseModel):
    role: NodeRole
    node_rank: int | None
    nnodes: int | None  # the current attempt's world (fewer than declared after a shrink)
    epoch: int
    endpoint: str | None  # HOST:PORT; None: node rank 0 has no member yet (stand by)
    declared: int | None = None  # the declared world (the global batch is defined on it)


class RegisterReply(BaseModel):
    agent_id: int
    run_id: int
    # The supervisor's identity of the run: the agent's local state belongs to it (a state
    # saved under another uuid is another run's, and is archived before any worker starts).
    run_uuid: str
    attempt: int
    next_seq: int
    heartbeat_interval_s: float
    # The agent's secret: every ingest sends it in X-Trainwarden-Agent-Credential, and a
    # re-registration presenting it there keeps the node.  Shown once; stored hashed.
    credential: str
    # What the node is in the run: a member (its node rank, the world, the rendezvous
    # endpoint of the membership epoch, which the agent rewrites torchrun's command for) or
    # a spare (runs nothing).
    membership: MembershipOut
    # A node silent this long is lost (and may be replaced): an agent that finds it was
    # stopped longer stops its workers before anything else.
    node_lost_s: float


class StepItem(_Wire):
    type: Literal["step"]
    v: U31 | None = None
    attempt: U31 | None = None  # default: the batch's attempt
    rank: U31
    local_rank: U31 | None = None
    world_size: Positive31 | None = None
    pid: U31 | None = None
    step: U31
    t: AgentTime | None = None  # default: the batch's sent_at
    batch_index: U63 | None = None
    loss: float | None = Field(default=None, description="NaN and Infinity are kept")
    samples: U31 | None = None
    tokens: U31 | None = None
    lr: float | None = Field(default=None, description="non-finite: stored as unknown")
    grad_norm: float | None = Field(default=None, description="NaN and Infinity are kept")
    data_s: Finite | None = None
    compute_s: Finite | None = None
    step_s: Finite | None = None
    dropped: U31 | None = None


class EventItem(_Wire):
    type: Literal["event"]
    v: U31 | None = None
    attempt: U31 | None = None
    rank: U31 | None = None
    local_rank: U31 | None = None
    pid: U31 | None = None
    t: AgentTime | None = None
    name: Line = line(min_length=1, max_length=100)
    step: U31 | None = None
    message: AgentText = ""
    details: AgentJSON = Field(default_factory=dict)


class CheckpointItem(_Wire):
    type: Literal["checkpoint"]
    v: U31 | None = None
    attempt: U31 | None = None
    rank: U31 | None = None
    t: AgentTime | None = None
    step: U31
    # strictly inside one of the agent's registered checkpoint roots (relative: to the first)
    path: Line = line(min_length=1, max_length=MAX_PATH)
    bytes: U63 | None = None
    save_s: Finite | None = None
    async_save: bool = False
    stall_s: Finite | None = None  # how long the save blocked the training loop
    lineage: Line | None = line(None, max_length=200)
    complete: bool = True  # protocol: sent once the checkpoint is complete on disk


class HeartbeatItem(_Wire):
    type: Literal["heartbeat"]
    t: AgentTime | None = None
    attempt: U31 | None = None
    state: Line = line("running", max_length=20)
    workers: list[dict[str, Any]] = Field(default_factory=list, max_length=_MAX_LIST)
    disk_free_bytes: U63 | None = None
    disk_total_bytes: U63 | None = None
    gpus: dict[str, Any] | None = None  # absent: not read this time (the last one stands)


def _cut_to(max_length: int, *, multiline: bool = True) -> Callable[[str], str]:
    """Free text from a worker is kept: cleaned and cut to ``max_length``, never refused."""
    def clean(v: str) -> str:
        return untrusted.clean(v, max_length, multiline=multiline)
    return clean


_KEPT = "a worker's text: controls shown as escapes, cut with a marker to "
WorkerName = Annotated[str, AfterValidator(_cut_to(300, multiline=False)),
                       Field(description=_KEPT + "300 characters")]
WorkerPath = Annotated[str, AfterValidator(_cut_to(MAX_PATH, multiline=False)),
                       Field(description=_KEPT + f"{MAX_PATH} characters")]
WorkerHost = Annotated[str, AfterValidator(_cut_to(255, multiline=False)),
                       Field(description=_KEPT + "255 characters")]
WorkerMessage = Annotated[str, AfterValidator(_cut_to(2000)),
                          Field(description=_KEPT + "2000 characters")]
WorkerTraceback = Annotated[str, AfterValidator(_cut_to(8000)),
                            Field(description=_KEPT + "8000 characters")]


class RootFrame(_Wire):
    """A traceback frame: file, line, function."""

    file: WorkerPath
    line: U31
    function: WorkerName


class RootCause(_Wire):
    """Why a rank failed, as the agent read it from what the worker left
    (``trainwarden.agent.core.rootcause.RootCause``)."""

    exc_type: WorkerName
    message: WorkerMessage = ""
    frame: RootFrame | None = None  # the innermost frame
    user_frame: RootFrame | None = None  # the innermost frame of the user's code
    traceback: WorkerTraceback = ""  # its last lines
    source: RootCauseSource | None = None
    rank: U31 | None = None
    host: WorkerHost | None = None

    @field_validator("source", mode="before")
    @classmethod
    def _source(cls, v: Any) -> Any:
        # A newer agent's source (or any other value) is dropped, not refused.
        return v if isinstance(v, str) and v in set(RootCauseSource) else None


class FailedRank(_Wire):
    """One failed worker of an exit, as torchrun's error summary names it (more keys kept)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=True, ser_json_inf_nan="constants")
    rank: U31 | None = None
    local_rank: U31 | None = None
    exit_code: I32 | None = None
    signal: U31 | None = None
    pid: U31 | None = None
    # The worker's own last words (parsed from its stderr): kept, their control characters
    # (colour codes, a NUL) as visible escapes.
    message: AgentText | None = None
    root_cause: RootCause | None = None
    # torchrun itself failed before any worker did (its rendezvous, say): rank is None
    launcher: bool | None = None

    @field_validator("root_cause", "launcher", mode="wrap")
    @classmethod
    def _root_cause(cls, v: Any, handler: Any) -> Any:
        # Evidence, not a claim: a root cause (or its launcher mark) that does not validate
        # is dropped, and the exit (the crash) is kept.
        try:
            return handler(v)
        except ValueError:
            return None

    @model_validator(mode="after")
    def _clean_extra(self) -> FailedRank:
        # The keys kept beyond the known ones are the worker's too: the same rule.
        if self.__pydantic_extra__:
            self.__pydantic_extra__ = untrusted.clean_json(self.__pydantic_extra__)
        return self


class ExitItem(_Wire):
    type: Literal["exit"]
    t: AgentTime | None = None
    attempt: U31 | None = None
    exit_code: I32 | None = None
    signal: U31 | None = None
    outcome: ExitOutcome
    failed_ranks: list[FailedRank] = Field(default_factory=list, max_length=_MAX_LIST)


class CommandResultItem(_Wire):
    type: Literal["command_result"]
    t: AgentTime | None = None
    command_id: U31
    status: Literal["delivered", "done", "failed"]  # trainwarden.agent.core.states.COMMAND_RESULTS
    detail: AgentText = ""


Item = Annotated[
    StepItem | EventItem | CheckpointItem | HeartbeatItem | ExitItem | CommandResultItem,
    Field(discriminator="type"),
]


class IngestBatch(_Wire):
    agent_id: U31
    seq: U63
    sent_at: AgentTime | None = None
    attempt: U31 = 0
    dropped: U31 = 0
    items: list[Item] = Field(default_factory=list)

    def made_at(self) -> float | None:
        """When the agent made the batch: its heartbeat's time (the agent puts one in every
        batch as it spools it), else the send time.  A batch that waited in the agent's
        spool behind a slow supervisor was made long before it was sent."""
        for it in reversed(self.items):
            if isinstance(it, HeartbeatItem) and it.t is not None:
                return it.t
        return self.sent_at

    def content_digest(self) -> str:
        """What the batch says, as a short hash: its attempt and items as understood (the
        fields that only say when and how it was sent, ``sent_at`` and ``dropped``, are left
        out, and so are values at their default, so that a replay by a newer agent or to a
        newer supervisor reads the same).  A replayed (agent_id, seq) with another digest is
        a different batch under a used sequence number.

        The text hashed is ``model_dump_json(include={"attempt", "items"},
        exclude_defaults=True)``, assembled from each item's own serializer: the list's
        serializer tries the union's types for every item, work an item's own serializer
        skips, and the digest is computed for every batch stored."""
        parts = []
        if self.attempt != 0:  # (the defaults are left out)
            parts.append(f'"attempt":{self.attempt}')
        if self.items:
            items = b",".join([it.__pydantic_serializer__.to_json(it, exclude_defaults=True)
                               for it in self.items])
            parts.append(f'"items":[{items.decode()}]')
        data = "{" + ",".join(parts) + "}"
        return hashlib.blake2b(data.encode(), digest_size=16).hexdigest()


class CommandOut(BaseModel):
    id: int
    kind: CommandKind
    attempt: int
    plan: dict[str, Any] | None = None
    not_before: float | None = None
    reason: str = ""
    collect_stacks: bool = False


class IngestReply(BaseModel):
    seq: int
    duplicate: bool
    attempt: int
    commands: list[CommandOut]
    # Checkpoint paths the workers' retention must keep (the agent pins them).
    protect: list[str] = Field(default_factory=list)
    # While the supervisor is behind (and a while after): send a batch this often, at most
    # (seconds); absent or null: the agent's own interval.  Nothing is dropped, batches grow.
    batch_interval_s: float | None = None
    # What the node is in the run now, and the membership epoch: a node that is no longer a
    # member (it was replaced while silent) stops its workers at once.
    role: NodeRole = NodeRole.MEMBER
    epoch: int = 0


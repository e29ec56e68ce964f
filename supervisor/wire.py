"""Pydantic models mirroring ``agent/protocol.py`` (the agent <-> supervisor HTTP shapes).

The supervisor validates every request against these before anything is stored.  Unknown
fields are ignored (a newer agent may send more), unknown item types are refused (the batch
would otherwise be half understood).  Floats keep NaN/Infinity: a NaN loss is a signal.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.core.states import CommandKind, ExitOutcome

NonNeg = Annotated[int, Field(ge=0)]


class _Wire(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=True)


class RegisterRequest(_Wire):
    run: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")
    node: str = Field(min_length=1, max_length=200)
    hostname: str = Field(default="", max_length=255)
    pid: int | None = None
    command: list[str] = Field(default_factory=list)
    nproc_per_node: Annotated[int, Field(ge=1)] | None = None
    checkpoint_root: str | None = None
    agent_version: str = Field(default="", max_length=50)
    # Replace the (run, node)'s live agent (its credential is revoked): the operator token
    # only, an audited action.
    takeover: bool = False


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


class StepItem(_Wire):
    type: Literal["step"]
    v: int | None = None
    attempt: NonNeg | None = None  # default: the batch's attempt
    rank: NonNeg
    local_rank: NonNeg | None = None
    world_size: Annotated[int, Field(ge=1)] | None = None
    pid: int | None = None
    step: NonNeg
    t: float | None = None  # default: the batch's sent_at
    batch_index: NonNeg | None = None
    loss: float | None = None
    samples: NonNeg | None = None
    tokens: NonNeg | None = None
    lr: float | None = None
    grad_norm: float | None = None
    data_s: float | None = None
    compute_s: float | None = None
    step_s: float | None = None
    dropped: NonNeg | None = None


class EventItem(_Wire):
    type: Literal["event"]
    v: int | None = None
    attempt: NonNeg | None = None
    rank: NonNeg | None = None
    local_rank: NonNeg | None = None
    pid: int | None = None
    t: float | None = None
    name: str = Field(min_length=1, max_length=100)
    step: NonNeg | None = None
    message: str = ""
    details: dict[str, Any] = Field(default_factory=dict)


class CheckpointItem(_Wire):
    type: Literal["checkpoint"]
    v: int | None = None
    attempt: NonNeg | None = None
    rank: NonNeg | None = None
    t: float | None = None
    step: NonNeg
    path: str = Field(min_length=1)
    bytes: NonNeg | None = None
    save_s: float | None = None
    async_save: bool = False
    lineage: str | None = None
    complete: bool = True  # protocol: sent once the checkpoint is complete on disk


class HeartbeatItem(_Wire):
    type: Literal["heartbeat"]
    t: float | None = None
    attempt: NonNeg | None = None
    state: str = Field(default="running", max_length=20)
    workers: list[dict[str, Any]] = Field(default_factory=list, max_length=4096)
    disk_free_bytes: NonNeg | None = None
    disk_total_bytes: NonNeg | None = None
    gpus: dict[str, Any] | None = None  # absent: not read this time (the last one stands)


class ExitItem(_Wire):
    type: Literal["exit"]
    t: float | None = None
    attempt: NonNeg | None = None
    exit_code: int | None = None
    signal: int | None = None
    outcome: ExitOutcome
    failed_ranks: list[dict[str, Any]] = Field(default_factory=list)


class CommandResultItem(_Wire):
    type: Literal["command_result"]
    t: float | None = None
    command_id: int
    status: Literal["delivered", "done", "failed"]  # agent.core.states.COMMAND_RESULTS
    detail: str = ""


Item = Annotated[
    StepItem | EventItem | CheckpointItem | HeartbeatItem | ExitItem | CommandResultItem,
    Field(discriminator="type"),
]


class IngestBatch(_Wire):
    agent_id: int
    seq: NonNeg
    sent_at: float | None = None
    attempt: NonNeg = 0
    dropped: NonNeg = 0
    items: list[Item] = Field(default_factory=list)


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


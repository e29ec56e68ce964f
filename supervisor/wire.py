"""Pydantic models mirroring ``agent/protocol.py`` (the agent <-> supervisor HTTP shapes).

The supervisor validates every request against these before anything is stored.  Unknown
fields are ignored (a newer agent may send more), unknown item types are refused (the batch
would otherwise be half understood).  Floats keep NaN/Infinity: a NaN loss is a signal.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agent.core.states import CommandKind, ExitOutcome
from supervisor import checkpoint_paths

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
    # (one root, as the first agents sent it; it joins checkpoint_roots, first)
    checkpoint_root: str | None = None
    checkpoint_roots: list[Annotated[str, Field(max_length=checkpoint_paths.MAX_PATH)]] = Field(
        default_factory=list, max_length=checkpoint_paths.MAX_ROOTS,
        description="the directories this agent's checkpoints are saved in (absolute, not "
                    "'/'): every checkpoint path it reports must lie strictly inside one, "
                    "and a relative one is resolved against the first")
    agent_version: str = Field(default="", max_length=50)

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


class RegisterReply(BaseModel):
    agent_id: int
    run_id: int
    # The supervisor's identity of the run: the agent's local state belongs to it (a state
    # saved under another uuid is another run's, and is archived before any worker starts).
    run_uuid: str
    attempt: int
    next_seq: int
    heartbeat_interval_s: float


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
    # strictly inside one of the agent's registered checkpoint roots (relative: to the first)
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


"""Table definitions (SQLAlchemy 2 declarative).  The schema is owned by Alembic migrations;
``tests/supervisor/store/test_sup_migrations.py`` checks that the two agree.

Conventions, and why:

* times are ``Float`` unix seconds: portable, cheap to insert in bulk, what the wire carries;
* floats that may be non-finite (loss, grad norm) have a companion ``*_special`` column
  (``"nan"``, ``"inf"``, ``"-inf"``): SQLite stores NaN as NULL, and a NaN loss is a signal that
  must survive storage; the value column is NULL then;
* the hot tables (``rank_steps``, ``step_aggregates``) are written only through Core bulk
  statements in ``ingest.py``; the ORM classes exist for the schema and for readable queries;
* JSON columns read back as the container their annotation names (``JSONDict``,
  ``JSONList``), whatever the row holds: every reader may index them without a type check.
"""

from __future__ import annotations

import uuid as _uuid
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    true,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from trainwarden.agent.core.states import AgentState, CommandStatus, NodeRole
from trainwarden.supervisor.enums import ActionStatus, HostState, IncidentStatus, RunStatus

# Stable constraint names so Alembic migrations can address them on every backend.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# 64-bit ids for the tables that grow with every step; SQLite only auto-increments INTEGER.
BigId = BigInteger().with_variant(Integer(), "sqlite")


class _JSONShape(TypeDecorator[Any]):
    """A JSON column that reads back as one kind of container.  A row holding anything else
    (another type, or text that is not JSON at all: an older version, a bug, a hand edit)
    reads as the empty container, or as NULL where the column is nullable, so the pages,
    the API and the evaluator never meet a string where they index a dict.  Written values
    are stored as given (the DDL is plain JSON: no migration)."""

    impl = JSON
    cache_ok = True
    kind: type = dict

    def __init__(self, *, nullable: bool = False) -> None:
        super().__init__()
        self.nullable = nullable

    def result_processor(self, dialect: Any, coltype: Any) -> Any:
        inner = self.impl_instance.result_processor(dialect, coltype)

        def process(value: Any) -> Any:
            if inner is not None:
                try:
                    value = inner(value)
                except ValueError:  # text that is not JSON (SQLite stores any text)
                    value = None
            return self.process_result_value(value, dialect)

        return process

    def process_result_value(self, value: Any, dialect: Any) -> Any:
        if isinstance(value, self.kind):
            return value
        if value is None and self.nullable:
            return None
        return self._wrong(value)

    def _wrong(self, value: Any) -> Any:
        return None if self.nullable else self.kind()


class JSONDict(_JSONShape):
    """A JSON object column; another value reads as NULL where the column is nullable (a
    GPU reading or a plan that is not one: none), else as ``{"value": it}`` (details still
    shown, never indexed by mistake)."""

    kind = dict
    cache_ok = True

    def _wrong(self, value: Any) -> Any:
        if value is None or self.nullable:
            return None if self.nullable else {}
        return {"value": value}


class JSONList(_JSONShape):
    """A JSON array column; another value reads as empty (NULL where nullable)."""

    kind = list
    cache_ok = True


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Run(Base):
    __tablename__ = "runs"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    # The supervisor's identity of the run, issued when the run is created and sent in the
    # registration reply: an agent's local state belongs to it, not to the run's name (a
    # reused name on a fresh database is another run).
    uuid: Mapped[str] = mapped_column(String(36), unique=True,
                                      default=lambda: str(_uuid.uuid4()))
    status: Mapped[str] = mapped_column(String(20), default=RunStatus.RUNNING)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    # The automatic restarts decided so far (the policy's backoff grows with it).  Not the
    # run's restarts as shown: those are counted from its restart actions
    # (``policy.restart_counts``), an operator's restart or rollback included.
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str] = mapped_column(Text, default="")  # why the status last changed
    # Checkpoint paths the workers' retention must keep (policy.protected_checkpoints, set
    # by the evaluator); every ingest reply carries them to the agents, who pin them.
    protected: Mapped[list[Any] | None] = mapped_column(JSONList(nullable=True),
                                                           nullable=True)
    # The membership epoch: it grows whenever the policy changes the run's members (a spare
    # takes a lost node's rank); a command carries it, and an agent outside the current
    # members stops its workers.
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # The world the members' torchrun command declares (--nnodes), from the first member.
    nnodes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The smallest world the run accepts (agent --min-nodes); None: the declared one (a lost
    # node without a spare is waited for, never shrunk away).
    min_nodes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The nodes the current attempt runs on, after a shrink or a grow; None: ``nnodes``.
    world_nnodes: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # The shape of the first member's command, fixed with the run: "torchrun" (a torchrun
    # launch, its world in ``nnodes``) or "plain"; None before any member registered.
    launcher: Mapped[str | None] = mapped_column(String(16), nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class Agent(Base):
    """One node agent of one run (one per node)."""

    __tablename__ = "agents"
    __table_args__ = (UniqueConstraint("run_id", "node"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    node: Mapped[str] = mapped_column(String(200))
    hostname: Mapped[str] = mapped_column(String(255), default="")
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    command: Mapped[list[Any]] = mapped_column(JSONList(), default=list)
    nproc_per_node: Mapped[int | None] = mapped_column(Integer, nullable=True)
    checkpoint_root: Mapped[str | None] = mapped_column(Text, nullable=True)  # the first root
    # The directories the agent's checkpoints are saved in, normalised (registration): every
    # checkpoint path it reports must lie strictly inside one
    # (``trainwarden.supervisor.contract.checkpoint_paths``)
    checkpoint_roots: Mapped[list[Any] | None] = mapped_column(JSONList(nullable=True),
                                                               nullable=True)
    agent_version: Mapped[str] = mapped_column(String(50), default="")
    registered_at: Mapped[float] = mapped_column(Float)
    last_seen_at: Mapped[float] = mapped_column(Float)
    attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)  # as last reported
    state: Mapped[str] = mapped_column(String(20), default=AgentState.REGISTERED)
    disk_free_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    disk_total_bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    # From the newest heartbeat that carried them: the workers' CPU and memory
    # ([{rank, local_rank, pid, cpu_percent, rss_bytes}]) and the GPU readings (NVML).
    workers: Mapped[list[Any] | None] = mapped_column(JSONList(nullable=True), nullable=True)
    gpus: Mapped[dict[str, Any] | None] = mapped_column(JSONDict(nullable=True), nullable=True)
    dropped: Mapped[int] = mapped_column(Integer, default=0)
    # A member holds a node rank of the run's world; a spare runs nothing until the policy
    # gives it the rank of a lost or cordoned member (``NodeRole``).
    role: Mapped[str] = mapped_column(String(16), default=NodeRole.MEMBER,
                                      server_default=NodeRole.MEMBER.value)
    node_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # Where this node's torchrun hosts the rendezvous when the policy picks it (an address
    # the other nodes reach), and its capacity beside nproc_per_node: devices (GPUs) seen.
    address: Mapped[str] = mapped_column(String(255), default="", server_default="")
    devices: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # What the node registered as (a NodeRole): a run one registered into as a spare has
    # spares configured, and an alert says when none is left.
    joined_as: Mapped[str] = mapped_column(String(16), default=NodeRole.MEMBER,
                                           server_default=NodeRole.MEMBER.value)
    # Registered with a token trusted for its host (one not scoped to runs): its evidence
    # about the node moves the shared health ledger; otherwise it counts in this run only.
    host_trusted: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())
    # Why the node is cordoned in this run only (evidence from a source not trusted for the
    # host); None: not cordoned here.  The shared ledger's cordons are ``hosts``'.
    cordon: Mapped[str | None] = mapped_column(Text, nullable=True)
    # The NVML counters last seen from this agent, when it is not trusted for its host (a
    # trusted agent's are kept with the host, ``Host.gpu_counters``).
    gpu_counters: Mapped[dict[str, Any] | None] = mapped_column(JSONDict(nullable=True),
                                                                nullable=True)
    # When the node's death was confirmed before the node-lost deadline (silent, and its
    # peers' connections to it failed): not fit to run until it is heard from after it.
    lost_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class AgentCredential(Base):
    """The secret an agent proves itself with on every ingest (``X-Trainwarden-Agent-
    Credential``): only its SHA-256 digest is kept, one per agent.  A new one replaces it
    (registration of a new incarnation, an operator's takeover): the old one is revoked."""

    __tablename__ = "agent_credentials"

    agent_id: Mapped[int] = mapped_column(
        ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True
    )
    # "sha256:<hex>"; None: revoked by an operator (the node's next registration claims it)
    secret_hash: Mapped[str | None] = mapped_column(String(71), nullable=True)
    # The one an operator revoked: an agent presenting it is told it was replaced.
    revoked_hash: Mapped[str | None] = mapped_column(String(71), nullable=True)
    issued_at: Mapped[float] = mapped_column(Float)


class ApiToken(Base):
    """A token with a role (viewer, agent, operator, admin), optionally scoped to one run or
    a run-name prefix (``name*``).  Only its SHA-256 digest is kept."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    role: Mapped[str] = mapped_column(String(20))
    scope: Mapped[str | None] = mapped_column(String(201), nullable=True)
    secret_hash: Mapped[str] = mapped_column(String(71), unique=True)
    created_at: Mapped[float] = mapped_column(Float)
    last_used_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Rank(Base):
    """Latest report of each rank of a run (one row per rank, upserted on ingest)."""

    __tablename__ = "ranks"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    agent_id: Mapped[int] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"))
    local_rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    t: Mapped[float] = mapped_column(Float)
    data_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    compute_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    step_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_special: Mapped[str | None] = mapped_column(String(4), nullable=True)
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    grad_norm_special: Mapped[str | None] = mapped_column(String(4), nullable=True)


class RankStep(Base):
    """Per-rank timings of each step (the straggler detector's input)."""

    __tablename__ = "rank_steps"
    __table_args__ = (Index("ix_rank_steps_run_attempt_step", "run_id", "attempt", "step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    t: Mapped[float] = mapped_column(Float)
    batch_index: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    data_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    compute_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    step_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_special: Mapped[str | None] = mapped_column(String(4), nullable=True)
    grad_norm: Mapped[float | None] = mapped_column(Float, nullable=True)
    grad_norm_special: Mapped[str | None] = mapped_column(String(4), nullable=True)
    lr: Mapped[float | None] = mapped_column(Float, nullable=True)


class RankRollup(Base):
    """Per-rank summary of the ``rank_steps`` rows of one bucket of ``bucket_steps`` steps
    (``bucket_start``: its first step, a multiple of ``bucket_steps``) that retention deleted
    (``trainwarden.supervisor.control.retention``).
    Merged additively: rows that arrive late for a bucket already rolled up add to it.  Each
    measure has its own count of non-NULL values (``*_n``); ``loss_nonfinite`` counts the
    NaN/Inf losses (not in the loss sums)."""

    __tablename__ = "rank_rollups"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket_start: Mapped[int] = mapped_column(Integer, primary_key=True)
    bucket_steps: Mapped[int] = mapped_column(Integer)
    rows: Mapped[int] = mapped_column(Integer)
    step_first: Mapped[int] = mapped_column(Integer)
    step_last: Mapped[int] = mapped_column(Integer)
    t_first: Mapped[float] = mapped_column(Float)
    t_last: Mapped[float] = mapped_column(Float)
    data_s_n: Mapped[int] = mapped_column(Integer)
    data_s_sum: Mapped[float | None] = mapped_column(Float, nullable=True)
    data_s_max: Mapped[float | None] = mapped_column(Float, nullable=True)
    compute_s_n: Mapped[int] = mapped_column(Integer)
    compute_s_sum: Mapped[float | None] = mapped_column(Float, nullable=True)
    compute_s_max: Mapped[float | None] = mapped_column(Float, nullable=True)
    step_s_n: Mapped[int] = mapped_column(Integer)
    step_s_sum: Mapped[float | None] = mapped_column(Float, nullable=True)
    step_s_max: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_n: Mapped[int] = mapped_column(Integer)
    loss_sum: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_min: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_max: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_nonfinite: Mapped[int] = mapped_column(Integer)


class StepBatch(Base):
    """Rank 0's global batch index of each step whose ``rank_steps`` rows retention deleted:
    a rollback names the batches to skip from a checkpoint's step, however old."""

    __tablename__ = "step_batches"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    batch_index: Mapped[int] = mapped_column(BigInteger)


class StepAggregate(Base):
    """One row per (run, attempt, step), merged across ranks and agents as reports arrive.

    Loss statistics cover the finite values; ``loss_nonfinite`` counts the NaN/Inf ones."""

    __tablename__ = "step_aggregates"

    run_id: Mapped[int] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True
    )
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    ranks: Mapped[int] = mapped_column(Integer, default=0)
    loss_sum: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_count: Mapped[int] = mapped_column(Integer, default=0)
    loss_min: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_max: Mapped[float | None] = mapped_column(Float, nullable=True)
    loss_nonfinite: Mapped[int] = mapped_column(Integer, default=0)
    grad_norm_nonfinite: Mapped[int] = mapped_column(Integer, default=0)
    samples: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    step_s_max: Mapped[float | None] = mapped_column(Float, nullable=True)
    t_first: Mapped[float] = mapped_column(Float)
    t_last: Mapped[float] = mapped_column(Float)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (Index("ix_checkpoints_run_t", "run_id", "t"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    agent_id: Mapped[int | None] = mapped_column(
        ForeignKey("agents.id", ondelete="SET NULL"), nullable=True
    )
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    bytes: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    lineage: Mapped[str | None] = mapped_column(String(200), nullable=True)
    complete: Mapped[bool] = mapped_column(Boolean, default=True)
    save_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    async_save: Mapped[bool] = mapped_column(Boolean, default=False)
    # How long the save blocked the training loop (None: a reporter that does not say).
    stall_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    t: Mapped[float] = mapped_column(Float)
    # On a branch a rollback abandoned: never offered as the newest checkpoint again.
    abandoned: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())


class Event(Base):
    __tablename__ = "events"
    __table_args__ = (Index("ix_events_run_t", "run_id", "t"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    agent_id: Mapped[int | None] = mapped_column(
        ForeignKey("agents.id", ondelete="SET NULL"), nullable=True
    )
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    t: Mapped[float] = mapped_column(Float)
    name: Mapped[str] = mapped_column(String(100))
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    message: Mapped[str] = mapped_column(Text, default="")
    details: Mapped[dict[str, Any]] = mapped_column(JSONDict(), default=dict)
    # The agent was a member of the run when the event arrived: a spare's, a replaced
    # node's or a non-member's events are kept for the record and never acted on.
    member: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())


class Exit(Base):
    """A local worker group (torchrun) ended on one node; the evaluator reads the unhandled ones."""

    __tablename__ = "exits"
    __table_args__ = (Index("ix_exits_handled", "handled", "run_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    agent_id: Mapped[int] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"))
    attempt: Mapped[int] = mapped_column(Integer)
    t: Mapped[float] = mapped_column(Float)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    signal: Mapped[int | None] = mapped_column(Integer, nullable=True)
    outcome: Mapped[str] = mapped_column(String(20))
    failed_ranks: Mapped[list[Any]] = mapped_column(JSONList(), default=list)
    handled: Mapped[bool] = mapped_column(Boolean, default=False)
    # what the evaluator made of it: failure | completed | late | ignored
    verdict: Mapped[str | None] = mapped_column(String(20), nullable=True)


class Incident(Base):
    __tablename__ = "incidents"
    __table_args__ = (Index("ix_incidents_run_id", "run_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(30))  # an IncidentKind (a detector may add kinds)
    status: Mapped[str] = mapped_column(String(20), default=IncidentStatus.OPEN)
    # Where it started (a loss spike's first high step, a hang's last step, ...).
    step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    attempt: Mapped[int] = mapped_column(Integer)
    cause: Mapped[str] = mapped_column(Text, default="")
    agent_id: Mapped[int | None] = mapped_column(
        ForeignKey("agents.id", ondelete="SET NULL"), nullable=True
    )
    node: Mapped[str | None] = mapped_column(String(200), nullable=True)
    rank: Mapped[int | None] = mapped_column(Integer, nullable=True)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    signal: Mapped[int | None] = mapped_column(Integer, nullable=True)
    details: Mapped[dict[str, Any]] = mapped_column(JSONDict(), default=dict)
    opened_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float | None] = mapped_column(Float, nullable=True)  # while it lasts
    resolved_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Action(Base):
    """An audited decision: what, why, which incident, who, when, and how it went."""

    __tablename__ = "actions"
    __table_args__ = (Index("ix_actions_run_id", "run_id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    incident_id: Mapped[int | None] = mapped_column(
        ForeignKey("incidents.id", ondelete="SET NULL"), nullable=True
    )
    kind: Mapped[str] = mapped_column(String(20))  # an ActionKind: restart | stop
    reason: Mapped[str] = mapped_column(Text, default="")
    # The budget a restart counts against (crash, hang, node_lost, spike, operator) and the
    # run's highest step when it was decided (for the no-progress stop).
    cause: Mapped[str | None] = mapped_column(String(20), nullable=True)
    high_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    # A rollback: the step it goes back to.  Checkpoints of earlier attempts beyond it are
    # on the abandoned branch, also those that arrive late (the old workers ran on a little).
    rollback_to_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    actor: Mapped[str] = mapped_column(String(100))  # an Actor: policy | operator
    # queued -> delivered -> restarted -> resumed (restart); queued -> delivered -> done (stop);
    # failed when an agent reports the command failed
    status: Mapped[str] = mapped_column(String(20), default=ActionStatus.QUEUED)
    attempt: Mapped[int] = mapped_column(Integer)  # the attempt the action starts (or stops)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSONDict(nullable=True), nullable=True)
    not_before: Mapped[float | None] = mapped_column(Float, nullable=True)
    resumed_step: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    progress: Mapped[dict[str, Any]] = mapped_column(JSONDict(), default=dict)  # status -> time


class Command(Base):
    """One command for one agent; re-sent with every ingest reply until acknowledged."""

    __tablename__ = "commands"
    __table_args__ = (Index("ix_commands_agent_status", "agent_id", "status"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[int] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"))
    agent_id: Mapped[int] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"))
    action_id: Mapped[int | None] = mapped_column(
        ForeignKey("actions.id", ondelete="SET NULL"), nullable=True, index=True
    )
    kind: Mapped[str] = mapped_column(String(20))
    attempt: Mapped[int] = mapped_column(Integer)
    plan: Mapped[dict[str, Any] | None] = mapped_column(JSONDict(nullable=True), nullable=True)
    # A hang: the agent dumps every worker's stacks first, then kills the tree at once.
    collect_stacks: Mapped[bool] = mapped_column(Boolean, default=False,
                                                 server_default=false())
    not_before: Mapped[float | None] = mapped_column(Float, nullable=True)
    reason: Mapped[str] = mapped_column(Text, default="")
    # a CommandStatus: pending (not yet acknowledged), the agent's last result (delivered,
    # done, failed), or superseded by a newer decision
    status: Mapped[str] = mapped_column(String(20), default=CommandStatus.PENDING)
    sent_count: Mapped[int] = mapped_column(Integer, default=0)
    detail: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)


class IngestedBatch(Base):
    """Keys of stored batches: a replayed (agent_id, seq) is answered as a duplicate, or
    refused when its content differs."""

    __tablename__ = "ingested_batches"

    agent_id: Mapped[int] = mapped_column(
        ForeignKey("agents.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    received_at: Mapped[float] = mapped_column(Float)
    items: Mapped[int] = mapped_column(Integer)
    # IngestBatch.content_digest: a replay with other content is refused (NULL: stored before
    # digests were kept; any replay of it reads as a duplicate).
    digest: Mapped[str | None] = mapped_column(String(32), nullable=True)


class EvaluatorLease(Base):
    """Who runs the evaluator among the supervisor replicas on one Postgres database (one
    row per lease name).  ``epoch`` grows by one each time the lease changes hands (or its
    holder takes it again after letting it expire): every decision the evaluator writes is
    made in a transaction that checks the epoch is still its own (``store.lease``)."""

    __tablename__ = "evaluator_lease"

    name: Mapped[str] = mapped_column(String(50), primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))  # host:pid:nonce of the replica
    epoch: Mapped[int] = mapped_column(BigInteger)
    acquired_at: Mapped[float] = mapped_column(Float)
    renewed_at: Mapped[float] = mapped_column(Float)
    expires_at: Mapped[float] = mapped_column(Float)  # the database's clock, unix seconds


class Host(Base):
    """A node's standing in the health ledger, keyed by the agent's node name (``--node``,
    the hostname by default: a re-imaged node whose new agent keeps the name keeps its
    history).  A node without a row is healthy."""

    __tablename__ = "hosts"

    node: Mapped[str] = mapped_column(String(200), primary_key=True)
    # a HostState: healthy | cordoned | probation
    state: Mapped[str] = mapped_column(String(20), default=HostState.HEALTHY)
    reason: Mapped[str] = mapped_column(Text, default="")  # why the state last changed
    actor: Mapped[str] = mapped_column(String(100), default="")  # who changed it
    since: Mapped[float] = mapped_column(Float)  # when the state began
    updated_at: Mapped[float] = mapped_column(Float)
    # When an operator last uncordoned it: evidence older than this no longer counts (the
    # rule would cordon it again on the very failures it was cleared of).
    cleared_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    # NVML's counters as last seen, per GPU ({"ecc": {"0": 2}, "xid": {...}}): they are
    # volatile (a driver reload resets them), so evidence is an increase over the last seen.
    gpu_counters: Mapped[dict[str, Any]] = mapped_column(JSONDict(), default=dict)


class HostEvidence(Base):
    """One piece of evidence against a node (an ``EvidenceKind``), recorded once: ``source``
    names what it was read from (``incident:12``, ``event:40``) and a node holds each source
    once; NULL for evidence another way keeps idempotent (the GPU counters)."""

    __tablename__ = "host_evidence"
    __table_args__ = (Index("ix_host_evidence_node_t", "node", "t"),
                      UniqueConstraint("node", "source"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(30))
    run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="SET NULL"), nullable=True
    )
    attempt: Mapped[int | None] = mapped_column(Integer, nullable=True)
    t: Mapped[float] = mapped_column(Float)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONDict(), default=dict)
    source: Mapped[str | None] = mapped_column(String(200), nullable=True)
    # From a source trusted for the host (an agent registered with a token not scoped to
    # runs): it moves the shared ledger.  False: it counts against the node in its run only.
    trusted: Mapped[bool] = mapped_column(Boolean, default=True, server_default=true())


class HostAction(Base):
    """An audited change of a node's state: cordon, uncordon, probation_passed; who (the
    policy, or the operator token's ``Principal.actor``), why, and the evidence it rests on."""

    __tablename__ = "host_actions"
    __table_args__ = (Index("ix_host_actions_node", "node"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    node: Mapped[str] = mapped_column(String(200))
    kind: Mapped[str] = mapped_column(String(20))  # a HostActionKind
    actor: Mapped[str] = mapped_column(String(100))
    reason: Mapped[str] = mapped_column(Text, default="")
    run_id: Mapped[int | None] = mapped_column(
        ForeignKey("runs.id", ondelete="SET NULL"), nullable=True
    )
    evidence_ids: Mapped[list[Any]] = mapped_column(JSONList(), default=list)
    created_at: Mapped[float] = mapped_column(Float)


metadata = Base.metadata

"""The rows the store returns, typed (``TypedDict``: they are plain dicts, so the API renders
them as they are and callers index them as before, and mypy checks the keys and types).

A row of a whole table has every column of ``models``; the narrower rows are what one reader
selects.  Times are unix seconds; JSON columns come back decoded.
"""

from __future__ import annotations

import math
from typing import Any, TypedDict

from trainwarden.agent.core.states import AgentState, ExitOutcome
from trainwarden.supervisor.enums import (
    ActionKind,
    ActionStatus,
    EvidenceKind,
    HostActionKind,
    HostState,
    IncidentKind,
    IncidentStatus,
    RestartCause,
    RunStatus,
    Verdict,
)


class RunRow(TypedDict):
    id: int
    name: str
    uuid: str  # the supervisor's identity of the run (a reused name is another uuid)
    status: RunStatus
    attempt: int
    restarts: int
    reason: str
    protected: list[Any] | None
    created_at: float
    updated_at: float


class RegisteredAgent(TypedDict):
    """What registration answers (the rest of the reply is the server's settings)."""

    agent_id: int
    run_id: int
    run_uuid: str
    attempt: int
    next_seq: int
    credential: str | None  # a new secret (None: the one presented stays valid)
    claim: str  # how it claimed the node (a ``registry.Claim``)
    holder: Any  # the node's agent before (a ``credentials.NodeHolder``), or None
    membership: dict[str, Any]  # what it is in the run (``membership.member_view``)


class AgentRow(TypedDict):
    id: int
    run_id: int
    node: str
    hostname: str
    pid: int | None
    command: list[Any]
    nproc_per_node: int | None
    checkpoint_root: str | None
    checkpoint_roots: list[Any] | None
    agent_version: str
    registered_at: float
    last_seen_at: float
    attempt: int | None
    state: AgentState  # as last reported (a newer agent may report others)
    disk_free_bytes: int | None
    disk_total_bytes: int | None
    workers: list[Any] | None
    gpus: dict[str, Any] | None
    dropped: int
    role: str  # a NodeRole: member or spare
    node_rank: int | None
    address: str
    devices: int | None
    joined_as: str  # the NodeRole it registered as


class AgentLiveness(TypedDict):
    """What the detectors need of each agent (no JSON health columns: read every tick)."""

    id: int
    node: str
    state: AgentState
    last_seen_at: float
    disk_free_bytes: int | None
    disk_total_bytes: int | None


class AgentAttemptRow(TypedDict):
    """An agent that reports another attempt than its run's (``registry.agents_off_attempt``)."""

    id: int
    node: str
    attempt: int
    state: AgentState | None
    last_seen_at: float | None


class CheckpointRow(TypedDict):
    id: int
    run_id: int
    agent_id: int | None
    attempt: int
    step: int
    path: str
    bytes: int | None
    lineage: str | None
    complete: bool
    save_s: float | None
    async_save: bool
    t: float
    abandoned: bool


class IncidentRow(TypedDict):
    id: int
    run_id: int
    kind: IncidentKind
    status: IncidentStatus
    step: int | None
    attempt: int
    cause: str
    agent_id: int | None
    node: str | None
    rank: int | None
    exit_code: int | None
    signal: int | None
    details: dict[str, Any]
    opened_at: float
    updated_at: float | None
    resolved_at: float | None


class ActionRow(TypedDict):
    id: int
    run_id: int
    incident_id: int | None
    kind: ActionKind
    reason: str
    cause: RestartCause | None
    high_step: int | None
    rollback_to_step: int | None
    actor: str  # Actor.POLICY, or the operator's role and token (``AuthContext.actor``)
    status: ActionStatus
    attempt: int
    plan: dict[str, Any] | None
    not_before: float | None
    resumed_step: int | None
    created_at: float
    updated_at: float
    progress: dict[str, Any]


class RestartRow(TypedDict):
    """A restart-like action with the kind of the incident behind it (None: no incident)."""

    id: int
    kind: ActionKind
    actor: str
    status: ActionStatus
    attempt: int
    resumed_step: int | None
    created_at: float
    cause: RestartCause | None
    incident_kind: IncidentKind | None


class RestartSpent(TypedDict):
    """One decided restart, as the budgets count it."""

    cause: RestartCause | None
    high_step: int | None
    actor: str


class ExitRow(TypedDict):
    """An agent's exit report, with the agent's node."""

    id: int
    run_id: int
    agent_id: int
    attempt: int
    t: float
    exit_code: int | None
    signal: int | None
    outcome: ExitOutcome
    failed_ranks: list[Any]
    handled: bool
    verdict: Verdict | None
    node: str


class EventRow(TypedDict):
    id: int
    run_id: int
    agent_id: int | None
    attempt: int
    rank: int | None
    t: float
    name: str
    step: int | None
    message: str
    details: dict[str, Any]
    # Sent by a member of the run (False: a spare's, a replaced node's: recorded only).
    member: bool


class NodeEventRow(EventRow):
    """An event with the node of the agent that sent it (None: the supervisor's own)."""

    node: str | None
    host_trusted: bool | None  # the agent is trusted for its host (None: no agent)


class StepAggregateRow(TypedDict):
    run_id: int
    attempt: int
    step: int
    ranks: int
    loss_sum: float | None
    loss_count: int
    loss_min: float | None
    loss_max: float | None
    loss_nonfinite: int
    grad_norm_nonfinite: int
    samples: int
    tokens: int
    step_s_max: float | None
    t_first: float
    t_last: float


class RankProgressRow(TypedDict):
    """A rank's newest step report of an attempt, with its node."""

    rank: int
    step: int
    t: float
    node: str


class LossRow(TypedDict):
    """One step of the loss window (merged over ranks; ``loss``: the mean of the finite
    values, None when there were none)."""

    attempt: int
    step: int
    loss: float | None
    loss_sum: float | None
    loss_count: int
    loss_nonfinite: int
    grad_norm_nonfinite: int
    samples: int
    tokens: int
    t_first: float
    t_last: float


class Throughput(TypedDict):
    """Rates over the newest steps every rank delivered (None: not measurable yet)."""

    steps_per_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    ranks: int | None


class HostRow(TypedDict):
    """A node's standing in the health ledger (``hosts``)."""

    node: str
    state: HostState
    reason: str
    actor: str
    since: float
    updated_at: float
    cleared_at: float | None  # an operator's uncordon: evidence before it no longer counts


class EvidenceRow(TypedDict):
    id: int
    node: str
    kind: EvidenceKind
    run_id: int | None
    attempt: int | None
    t: float
    detail: dict[str, Any]
    source: str | None
    trusted: bool  # from a source trusted for the host (else: counts in its run only)


class HostActionRow(TypedDict):
    id: int
    node: str
    kind: HostActionKind
    actor: str  # Actor.POLICY, or the operator token's ``Principal.actor``
    reason: str
    run_id: int | None
    evidence_ids: list[Any]
    created_at: float


class HostSummary(HostRow):
    """A node as the hosts list shows it: its state, the evidence within the rule's window
    (how many, the newest), and whether an agent of it was seen (registered)."""

    evidence_count: int
    latest_evidence: EvidenceRow | None


def started_at(details: Any) -> float | None:
    """When an incident's condition began, as its detector saw it (``details["started_at"]``,
    e.g. a loss spike's first step's time): a finite number, else None (not known, or an older
    supervisor's incident)."""
    v = details.get("started_at") if isinstance(details, dict) else None
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)

"""The answers of the JSON routes, as the OpenAPI document declares them.

The routes return plain dicts (the store's rows, ``trainwarden.supervisor.store.rows``) rendered by
``SafeJSONResponse``: a non-finite float goes out as the string "NaN", "Infinity" or
"-Infinity", and a dict is sent as it is.  A FastAPI ``response_model`` would validate and
re-serialize every answer (a NaN as null, an int where a float is declared as ``1.0``, the
keys filtered), so these models are declared with ``documented`` (FastAPI's ``responses=``):
they describe the answer in ``/openapi.json`` and leave the answer itself alone.
``tests/supervisor/test_sup_response_models.py`` checks every route's real answer against
the schema declared for it, so the two cannot drift apart.

Times are unix seconds.  A field typed ``Real`` may carry a non-finite value as one of the
strings above."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from trainwarden.agent.core.rootcause import FailureClass
from trainwarden.supervisor.enums import (
    ActionStatus,
    EvidenceKind,
    HostActionKind,
    HostState,
    IncidentStatus,
    NodeState,
    RunStatus,
)

NonFinite = Literal["NaN", "Infinity", "-Infinity"]
Real = Annotated[float | NonFinite, Field(
    description='a number; not finite: "NaN", "Infinity" or "-Infinity"')]


def documented(model: type[BaseModel], status: int = 200,
               description: str = "Successful Response") -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a route whose answer ``model`` describes (the route's own
    ``status_code``: 200 unless it says)."""
    return {status: {"model": model, "description": description}}


class _Answer(BaseModel):
    # "from" and other keys that are no Python names are declared by alias.
    model_config = ConfigDict(populate_by_name=True)


# ---------------------------------------------------------------------------------------------
# runs


class Throughput(_Answer):
    """Rates over the newest steps every rank delivered (null: not measurable yet)."""

    steps_per_s: float | None
    samples_per_s: float | None
    tokens_per_s: float | None
    ranks: int | None = Field(description="the most ranks that reported one of those steps")


class CheckpointBrief(_Answer):
    """The run's newest complete checkpoint."""

    step: int
    path: str
    bytes: int | None
    attempt: int
    lineage: str | None
    t: float


class AgentBrief(_Answer):
    """One node (agent) of the run: its state as the supervisor judges it, and what it last
    reported."""

    id: int
    node: str
    hostname: str
    state: NodeState = Field(description="the node's state (``node_states``): starting, "
                                         "running, stopping, stopped, failed, waiting (a "
                                         "member standing by for a node), spare, lost "
                                         "(silent past the node-lost deadline, or confirmed "
                                         "dead), replaced (its node rank went to another "
                                         "node), finished")
    reported_state: str = Field(description="the agent's own state, as last reported")
    seen_s: float = Field(description="seconds since the node was last heard from")
    readings_stale: bool = Field(description="its workers, GPU and disk readings are the "
                                             "last it sent before it went silent or left: "
                                             "``seen_s`` old")
    attempt: int | None
    last_seen_at: float
    disk_free_bytes: int | None
    disk_total_bytes: int | None
    workers: list[Any] | None = Field(description="the workers' process stats (one object "
                                                  "per worker: rank, pid, cpu_percent, ...)")
    gpus: dict[str, Any] | None = Field(description="the node's GPUs as last read")
    dropped: int = Field(description="items the agent dropped (its spool full)")
    role: str = Field(description="member (holds a node rank) or spare (runs nothing until "
                                  "it takes a lost or cordoned member's rank)")
    node_rank: int | None = Field(description="the node rank a member holds")
    joined_as: str = Field(description="what the node registered as: member or spare")
    address: str = Field(description="where its torchrun hosts the rendezvous when it "
                                     "holds node rank 0")
    nproc_per_node: int | None = Field(description="its capacity: processes per node")
    devices: int | None = Field(description="its capacity: GPUs (null: none seen)")


class MembershipSummary(_Answer):
    """The run's nodes (``trainwarden.supervisor.control.membership.capacity``)."""

    nnodes: int | None = Field(description="the world the members' torchrun declares")
    epoch: int = Field(description="the membership epoch: it grows each time spares take "
                                   "node ranks")
    spares: int = Field(description="free spares: heard from within the node-lost deadline, "
                                    "not cordoned")
    spares_configured: bool = Field(description="a node registered into the run as a spare")
    missing: list[int] = Field(description="node ranks with no node fit to run and no spare "
                                           "to take them: the run stands by for them (the "
                                           "first 64 vacant ones listed)")
    missing_count: int = Field(0, description="how many node ranks wait for a node, listed "
                                              "in missing or not")
    world: int | None = Field(description="the nodes the current attempt runs on: fewer than "
                                          "nnodes while the run is shrunk")
    min_nodes: int | None = Field(description="the smallest world the run accepts (agent "
                                              "--min-nodes); null: nnodes (it never shrinks)")


class RunConditionOut(_Answer):
    """The run's condition at a glance (``trainwarden.supervisor.control.run_condition``)."""

    state: Literal["waiting", "shrunk"]
    summary: str = Field(description="what it is and how it ends, in one line")
    since: float | None = Field(description="when it began (unix seconds)")


class RunSummary(_Answer):
    id: int
    name: str
    uuid: str = Field(description="the supervisor's identity of the run (a reused name "
                                  "is another uuid)")
    status: RunStatus
    reason: str
    attempt: int
    restarts: int = Field(description="every time the run's workers were restarted, whatever "
                                      "the cause: the restart actions decided for it (a "
                                      "crash's, a hang's, a spike's rollback, an operator's "
                                      "restart or rollback)")
    restarts_by_cause: dict[str, int] = Field(
        description="``restarts`` by cause: crash, hang, node_lost, spike (the automatic "
                    "ones, each against its budget), operator, and replace, grow, partition "
                    "(counted against no budget)")
    step: int | None = Field(description="the newest step of the current attempt")
    step_at: float | None
    throughput: Throughput
    checkpoint: CheckpointBrief | None
    protected: list[str] = Field(description="checkpoint paths the workers' retention keeps "
                                             "besides the newest few")
    agents: list[AgentBrief]
    membership: MembershipSummary
    condition: RunConditionOut | None = Field(
        None, description="waiting for a node, or shrunk, with how it ends; null: neither")
    created_at: float
    updated_at: float


class RunList(_Answer):
    runs: list[RunSummary]


class BadputSeconds(_Answer):
    """Seconds of wall time lost, by cause (null: a cause not measured, see
    ``not_measured``)."""

    lost_progress: float | None
    detection: float | None
    restart: float | None
    requeue: float | None = Field(description="the wait for the new allocation of a "
                                               "scheduler job requeued without a lost node "
                                               "(fleet.requeue): from the requeue to the "
                                               "restart decided on the new allocation")
    startup: float | None
    checkpoint: float | None
    data_wait: float | None
    straggler: float | None
    capacity: float | None = Field(description="the slower steps of a shrunk world: of each "
                                                "step on k of N declared nodes, 1 - k/N of "
                                                "its time")
    idle: float | None
    other: float | None


class Goodput(_Answer):
    """Where the wall time from ``start`` to ``end`` went."""

    ettr: float | None = Field(description="productive / wall time (null before any wall "
                                           "time passed)")
    wall_s: float
    productive_s: float
    badput_s: BadputSeconds
    not_measured: dict[str, str] = Field(description="cause -> why it is not measured")
    steps_final: int = Field(description="steps on the final lineage")
    steps_lost: int = Field(description="step copies thrown away by restores")
    start: float
    end: float


class AnatomyTimes(_Answer):
    """The restart's milestones (null: not recorded)."""

    decided: float | None
    workers_stopped: float | None
    torchrun_started: float | None
    rendezvous_done: float | None
    preflight_done: float | None
    checkpoint_loaded: float | None
    first_step: float | None


class AnatomyPhases(_Answer):
    """Seconds of each phase (null where a milestone is missing, never 0 for unknown)."""

    stop_workers: float | None
    launch: float | None
    rendezvous: float | None
    preflight: float | None
    load_checkpoint: float | None
    first_step: float | None


class AnatomySpan(_Answer):
    phase: str = Field(description='a phase, or "a+b" for phases merged over a missing '
                                   "milestone")
    from_: str = Field(alias="from", description="milestone")
    to: str = Field(description="milestone")
    seconds: float


class RestartAnatomy(_Answer):
    times: AnatomyTimes
    phases_s: AnatomyPhases
    total_s: float | None = Field(description="decided -> first step, when both are known")
    spans: list[AnatomySpan]
    notes: list[str]


class LastRestart(_Answer):
    action_id: int
    attempt: int
    status: ActionStatus
    anatomy: RestartAnatomy | None


class IntervalInputs(_Answer):
    nodes: int
    failures: int
    observed_s: float
    save_stall_s: float
    restart_s: float
    interval_s: float | None
    prior_per_node_day: float | None
    min_failures: int


class IntervalMeasured(_Answer):
    checkpoints: int
    saves_timed: int
    intervals: int
    restarts_timed: int = Field(description="the restarts that reached their first step (the "
                                            "restart cost is their mean)")
    restarts: int = Field(description="the run's restarts (as on the run)")
    failure_kinds: list[str]


class CheckpointInterval(_Answer):
    """The recommended checkpoint interval against the current one."""

    rate_source: Literal["observed", "prior", "none"]
    rate_per_node_day: float | None
    failures_per_day: float | None
    mtbf_s: float | None
    young_s: float | None
    recommended_s: float | None
    current_s: float | None
    ettr_current: float | None
    ettr_recommended: float | None
    gain: float | None
    note: str
    inputs: IntervalInputs
    state: Literal["ok", "not_enough_data"]
    missing: list[str]
    measured: IntervalMeasured


class MfuBand(_Answer):
    name: str
    low: Real
    high: Real = Field(description='the top band\'s is "Infinity"')
    meaning: str


class RankShare(_Answer):
    """A rank's shares of the step and its MFU."""

    rank: int
    step_s: float | None
    data: float | None
    compute: float | None
    comm: float | None
    mfu: float | None
    compute_utilisation: float | None


class MfuWindow(_Answer):
    steps: int
    to_step: int | None


class FlopsDeclaration(_Answer):
    peak_flops_per_rank: float | None
    flops_per_sample: float | None
    flops_per_token: float | None
    baseline_per_device: float | None


class ScalingCause(_Answer):
    name: str
    verdict: str = Field(description="for | against | unknown")
    share: float | None
    evidence: str


class Scaling(_Answer):
    efficiency: float | None
    devices: int
    likely: str | None
    causes: list[ScalingCause]
    baseline_per_device: float | None


class MfuReport(_Answer):
    mfu: float | None
    band: MfuBand | None
    data_share: float | None
    comm_share: float | None
    ranks: list[RankShare]
    declaration_warning: str | None = Field(
        None, description="a figure above 100% (the run's MFU, a rank's MFU or compute "
                          "utilisation): the FLOPs declaration is off, and how to fix it")
    attempt: int
    window: MfuWindow
    unit: Literal["samples", "tokens"] | None
    throughput: float | None
    declared: FlopsDeclaration | None
    scaling: Scaling


class RunDetail(RunSummary):
    last_restart: LastRestart | None
    checkpoint_interval: CheckpointInterval
    mfu: MfuReport | None
    goodput: Goodput | None


class GoodputSeries(_Answer):
    run: str
    window_s: float
    current: Goodput | None
    window: Goodput | None
    points: list[Goodput]


class StepPoint(_Answer):
    """One step, or a bucket of steps (``step_from``..``step_to``)."""

    step_from: int
    step_to: int
    attempt: int
    rows: int = Field(description="steps in the point")
    ranks: int
    loss_min: float | None = Field(description="over finite values")
    loss_max: float | None
    loss_nonfinite: int
    grad_norm_nonfinite: int
    samples: int
    tokens: int
    step_s_max: float | None
    t: float
    loss_mean: float | None


class StepSeries(_Answer):
    run: str
    points: list[StepPoint] = Field(
        description="the final lineage: one attempt's row per step (the newest attempt whose "
                    "history continues to the present)")
    superseded: list[StepPoint] = Field(
        description="rows off the final lineage (an older attempt's steps a restart trained "
                    "again or threw away), bucketed per attempt; empty with ?attempt=")


class RankReport(_Answer):
    """A rank's latest report with its straggler score (null: none yet)."""

    run_id: int
    rank: int
    agent_id: int
    local_rank: int | None
    pid: int | None
    attempt: int
    step: int
    t: float
    data_s: float | None
    compute_s: float | None
    step_s: float | None
    loss: Real | None
    grad_norm: Real | None
    node: str
    score: float | None
    slow: bool | None


class StragglerSettings(_Answer):
    threshold: float
    window_steps: int
    min_steps: int
    min_excess_s: float


class RankList(_Answer):
    run: str
    ranks: list[RankReport]
    straggler: StragglerSettings


class RankRollup(_Answer):
    """One rank's summary of a bucket of steps whose per-rank rows were rolled up."""

    run_id: int
    attempt: int
    rank: int
    bucket_start: int
    bucket_steps: int
    rows: int
    step_first: int
    step_last: int
    t_first: float
    t_last: float
    data_s_n: int
    data_s_sum: float | None
    data_s_max: float | None
    compute_s_n: int
    compute_s_sum: float | None
    compute_s_max: float | None
    step_s_n: int
    step_s_sum: float | None
    step_s_max: float | None
    loss_n: int
    loss_sum: float | None
    loss_min: float | None
    loss_max: float | None
    loss_nonfinite: int
    data_s_mean: float | None
    compute_s_mean: float | None
    step_s_mean: float | None
    loss_mean: float | None


class RankRollups(_Answer):
    run: str
    attempt: int
    kept_from_step: int | None
    rolled_up_steps: tuple[int, int] | None = Field(description="[first, last] step")
    rollups: list[RankRollup]


class CheckpointRecord(_Answer):
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
    stall_s: float | None
    t: float
    abandoned: bool = Field(description="on a branch a rollback abandoned")


class CheckpointList(_Answer):
    run: str
    checkpoints: list[CheckpointRecord]


class IncidentRecord(_Answer):
    id: int
    run_id: int
    kind: str = Field(description="crash, hang, collective_timeout, node_lost, partition, "
                                  "straggler, loss_spike, nonfinite, attempt_mismatch, "
                                  "silent_data_corruption (an open set)")
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
    failure_class: FailureClass | None = Field(
        None, description="a crash's: user_code (an exception raised from the training "
                          "script's own code), machine (a signal, OOM, NCCL/gloo, a lost "
                          "node), storage (a full or read-only checkpoint disk) or "
                          "unknown; null for other incidents")
    root_cause: dict[str, Any] | None = Field(
        None, description="a crash's: the failed rank's exception (exc_type, message), its "
                          "innermost frame and innermost frame of the user's code (file, "
                          "line, function), the traceback's last lines, rank, host, source")


class IncidentList(_Answer):
    run: str
    incidents: list[IncidentRecord]


class ActionRecord(_Answer):
    """An audited decision and its progress."""

    id: int
    run_id: int
    incident_id: int | None
    kind: str = Field(description="restart (a rollback too), stop, takeover")
    reason: str
    cause: str | None = Field(description="the budget a restart counts against")
    high_step: int | None
    rollback_to_step: int | None
    actor: str
    status: ActionStatus
    attempt: int
    plan: dict[str, Any] | None
    not_before: float | None
    resumed_step: int | None
    created_at: float
    updated_at: float
    progress: dict[str, float] = Field(description="status -> when it was reached")
    anatomy: RestartAnatomy | None = Field(description="a restart's (null otherwise)")


class ActionList(_Answer):
    run: str
    actions: list[ActionRecord]


class EventRecord(_Answer):
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
    member: bool = Field(True, description="sent by a member of the run; false: by a spare, "
                                           "a replaced node or a non-member (kept for the "
                                           "record, never acted on)")


class EventList(_Answer):
    run: str
    events: list[EventRecord]


class OperatorDecision(_Answer):
    run: str
    action_id: int
    decision: str = Field(description="what was decided: restart | stop")


class RollbackAccepted(_Answer):
    run: str
    action_id: int
    checkpoint: int = Field(description="the checkpoint's id")
    step: int


class TakeoverDone(_Answer):
    run: str
    node: str
    agent_id: int = Field(description="the agent whose credential was revoked")
    action_id: int


# ---------------------------------------------------------------------------------------------
# hosts (the health ledger)


class EvidenceRecord(_Answer):
    """One piece of evidence against a node."""

    id: int
    node: str
    kind: EvidenceKind
    run_id: int | None
    attempt: int | None
    t: float = Field(description="when it happened (an incident's opening; for what an agent "
                                 "reported, when the supervisor learned of it)")
    detail: dict[str, Any] = Field(description="what happened (``what``), the run's name "
                                               "(``run``), and what it was read from")
    source: str | None = Field(description="what it was read from (incident:ID, event:ID; "
                                           "null for the GPU counters): recorded once")
    trusted: bool = Field(True, description="from a source trusted for the host (an agent "
                                            "registered with a token scoped to no run); "
                                            "false: it counts in its run only")


class HostActionRecord(_Answer):
    """An audited change of a node's state."""

    id: int
    node: str
    kind: HostActionKind
    actor: str = Field(description="policy, fleet (the scheduler's word), or the operator "
                                   "token's actor")
    reason: str
    run_id: int | None = Field(description="the run whose failure tipped a cordon over")
    evidence_ids: list[int] = Field(description="the evidence a cordon rests on")
    created_at: float


class HostStanding(_Answer):
    node: str
    state: HostState = Field(description="healthy, cordoned (never chosen as a member) or "
                                         "probation (healthy once it passes a preflight)")
    reason: str = Field(description="why the state last changed")
    actor: str = Field(description="who changed it (policy, or an operator); empty: never "
                                   "changed")
    since: float = Field(description="when the state began")
    updated_at: float
    cleared_at: float | None = Field(description="the last uncordon: evidence before it no "
                                                 "longer counts")


class HostEntry(HostStanding):
    evidence_count: int = Field(description="evidence against it in the rule's window")
    latest_evidence: EvidenceRecord | None = Field(description="its newest evidence, however "
                                                               "old")


class HostList(_Answer):
    window_s: float = Field(description="the cordon rule's window (cordon.window_s)")
    hosts: list[HostEntry]


class HostDetail(HostStanding):
    evidence: list[EvidenceRecord] = Field(description="newest first")
    actions: list[HostActionRecord] = Field(description="cordons, uncordons, passed "
                                                        "probations and the fleet's commands "
                                                        "with their output, newest first")


class HostChanged(_Answer):
    node: str
    state: HostState = Field(description="its state now")
    action_id: int = Field(description="the audited host action")


# ---------------------------------------------------------------------------------------------
# tokens


class TokenInfo(_Answer):
    name: str
    role: Literal["viewer", "agent", "operator", "admin"]
    scope: str | None
    created_at: float
    last_used_at: float | None


class NewToken(TokenInfo):
    token: str = Field(description="the secret, shown this once (stored hashed)")


class TokenList(_Answer):
    tokens: list[TokenInfo]


class TokenRevoked(_Answer):
    revoked: str


# ---------------------------------------------------------------------------------------------
# health


class Health(_Answer):
    status: Literal["ok"]


class EvaluatorLease(_Answer):
    holder: str
    epoch: int
    acquired_at: float
    expires_in_s: float


class EvaluatorStatus(_Answer):
    replica: str = Field(description="this replica's id (host:pid:nonce)")
    leader: bool
    epoch: int | None = Field(description="the lease epoch it leads under (null: standby; "
                                          "0 on SQLite)")
    since: float | None
    shared: bool
    lease: EvaluatorLease | None


# ---------------------------------------------------------------------------------------------
# the dashboard's feeds (not in the OpenAPI document: the page's own)


class RunState(_Answer):
    run: str
    status: RunStatus
    attempt: int
    restarts: int = Field(description="as on the run")
    version: str
    now: float


class Marker(_Answer):
    type: str = Field(description="spike, or the action's kind")
    kind: str
    from_: int = Field(alias="from")
    to: int
    label: str
    cost: str | None = Field(
        default=None, description="a spike's: the progress it cost against a rollback's cost, "
                                  "as its incident or event stated them")


class RankTimes(_Answer):
    rank: int
    node: str
    score: float
    slow: bool
    values: list[float | None]


class RankSeries(_Answer):
    attempt: int | None
    steps: list[int]
    threshold: float | None = Field(default=None, description="absent before the first step")
    series: list[RankTimes]
    median: list[float]


class MfuFeed(_Answer):
    unit: Literal["samples", "tokens"]
    factor: float


class RunSeries(_Answer):
    run: str
    markers: list[Marker]
    ranks: RankSeries
    mfu: MfuFeed | None
    goodput: Goodput | None

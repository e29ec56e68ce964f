"""The one place that decides.  Pure: facts in, a decision out; no I/O, time passed in.

One module per seam, every name re-exported here (callers write ``policy.on_exit``):

* ``core``: the facts decided from (the run, an exit, a finding, the run's recovery
  history), ``PolicyConfig`` and the restart budgets (per cause, the no-progress rule, the
  backoff).
* ``decisions``: what the policy returns (``Note``, ``Restart``, ``Stop``, ``Complete``,
  ``OpenIncident``, ``RecordEvent``).
* ``exits``: a worker group's exit (a crash and its cause, a hang, a completion; the rules
  that stop a run failing the same way twice).
* ``membership``: a node's death confirmed by its peers, a network partition, growing back,
  shrinking or waiting for a node, a member cordoned before its attempt trained.
* ``findings``: the detectors' findings, and the run's agents gone silent or back.
* ``rollback``: the rollback past a loss spike, NaN or silent data corruption.
* ``overload``: the supervisor's own overload, and the batch interval advised to agents.
* ``mismatch``: an agent that runs another attempt than the run's.
* ``protect``: the checkpoints retention must keep.
* ``hosts``: cordons, probation and the fleet's scheduler.
* ``operators``: an operator's restart, stop and rollback of a run.
"""

from __future__ import annotations

from trainwarden.supervisor.control.policy.core import (
    BUDGET_CAUSES,
    CAUSE_OF_KIND,
    OPERATOR_CAUSE,
    RESTART_CAUSES,
    RESTART_KINDS,
    ROLLBACK_KINDS,
    STOP_IDENTICAL_FAILURE,
    STOP_REPEATED_USER_ERROR,
    WATCH_KINDS,
    CrashCause,
    ExitFacts,
    FindingFacts,
    PolicyConfig,
    RecoveryFacts,
    RestartCounts,
    RunFacts,
    _int_or_none,
    backoff_s,
    budget_left,
    budget_of,
    budgets_left,
    restart_cause,
    restart_counts,
    restarts_without_progress,
    setting_name,
)
from trainwarden.supervisor.control.policy.decisions import (
    Complete,
    Decision,
    FindingDecision,
    IncidentSpec,
    Note,
    OpenIncident,
    RecordEvent,
    Restart,
    Stop,
)
from trainwarden.supervisor.control.policy.exits import (
    _rendezvous_port_taken,
    crash_cause,
    describe_exit,
    exit_incident,
    failure_phase,
    identical_failure,
    on_exit,
    reattribute,
    repeated_user_error,
)
from trainwarden.supervisor.control.policy.findings import (
    on_agents_back,
    on_agents_gone,
    on_finding,
)
from trainwarden.supervisor.control.policy.hosts import (
    Cordon,
    FleetPlan,
    HostDecision,
    PassProbation,
    Requeue,
    RequeueWanted,
    Uncordon,
    fleet_decisions,
    on_host_evidence,
    on_preflight_passed,
    operator_cordon,
    operator_uncordon,
    requeue_checked,
    requeue_when_no_spare,
)
from trainwarden.supervisor.control.policy.membership import (
    ASSUMED_INTERVAL_S,
    ASSUMED_RESTART_S,
    ASSUMED_STEP_S,
    ElasticFigures,
    RendezvousFacts,
    ResizeChoice,
    choose_shrink,
    corrupting,
    network_partition,
    node_death,
    on_corrupting_member,
    on_grow,
    on_member_cordoned,
    on_node_joined,
)
from trainwarden.supervisor.control.policy.mismatch import (
    MismatchDecision,
    MismatchFacts,
    Realign,
    RealignSent,
    on_attempt_mismatch,
)
from trainwarden.supervisor.control.policy.operators import (
    operator_restart,
    operator_rollback,
    operator_stop,
)
from trainwarden.supervisor.control.policy.overload import (
    advised_batch_interval,
    on_overload,
)
from trainwarden.supervisor.control.policy.protect import (
    PROTECT_MAX,
    ProtectFacts,
    protected_checkpoints,
)
from trainwarden.supervisor.control.policy.rollback import (
    rollback_for_sdc,
    rollback_for_spike,
    rollback_plan,
    sdc_message,
    spike_cost_of,
)

__all__ = [
    "ASSUMED_INTERVAL_S",
    "ASSUMED_RESTART_S",
    "ASSUMED_STEP_S",
    "BUDGET_CAUSES",
    "CAUSE_OF_KIND",
    "OPERATOR_CAUSE",
    "PROTECT_MAX",
    "RESTART_CAUSES",
    "RESTART_KINDS",
    "ROLLBACK_KINDS",
    "STOP_IDENTICAL_FAILURE",
    "STOP_REPEATED_USER_ERROR",
    "WATCH_KINDS",
    "Complete",
    "Cordon",
    "CrashCause",
    "Decision",
    "ElasticFigures",
    "ExitFacts",
    "FindingDecision",
    "FindingFacts",
    "FleetPlan",
    "HostDecision",
    "IncidentSpec",
    "MismatchDecision",
    "MismatchFacts",
    "Note",
    "OpenIncident",
    "PassProbation",
    "PolicyConfig",
    "ProtectFacts",
    "Realign",
    "RealignSent",
    "RecordEvent",
    "RecoveryFacts",
    "RendezvousFacts",
    "Requeue",
    "RequeueWanted",
    "ResizeChoice",
    "Restart",
    "RestartCounts",
    "RunFacts",
    "Stop",
    "Uncordon",
    "_int_or_none",
    "_rendezvous_port_taken",
    "advised_batch_interval",
    "backoff_s",
    "budget_left",
    "budget_of",
    "budgets_left",
    "choose_shrink",
    "corrupting",
    "crash_cause",
    "describe_exit",
    "exit_incident",
    "failure_phase",
    "fleet_decisions",
    "identical_failure",
    "network_partition",
    "node_death",
    "on_agents_back",
    "on_agents_gone",
    "on_attempt_mismatch",
    "on_corrupting_member",
    "on_exit",
    "on_finding",
    "on_grow",
    "on_host_evidence",
    "on_member_cordoned",
    "on_node_joined",
    "on_overload",
    "on_preflight_passed",
    "operator_cordon",
    "operator_restart",
    "operator_rollback",
    "operator_stop",
    "operator_uncordon",
    "protected_checkpoints",
    "reattribute",
    "repeated_user_error",
    "requeue_checked",
    "requeue_when_no_spare",
    "restart_cause",
    "restart_counts",
    "restarts_without_progress",
    "rollback_for_sdc",
    "rollback_for_spike",
    "rollback_plan",
    "sdc_message",
    "setting_name",
    "spike_cost_of",
]

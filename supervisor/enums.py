"""The statuses and kinds of the supervisor's own records, shared by the policy, the store,
the metrics and the dashboard (those that travel to and from the agents are in
``trainwarden.agent.core.states``).

``StrEnum``: each member is its value, so the store and the API hold the same plain strings
as before (no migration), and a value read back from the store compares equal to its member.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args

from trainwarden.agent.core.findings import FindingKind

# A token's role: viewer (reads), agent (registers node agents and posts their batches),
# operator (acts on runs), admin (everything, the tokens included).
Role = Literal["viewer", "agent", "operator", "admin"]
ROLES: tuple[Role, ...] = get_args(Role)


class RunStatus(StrEnum):
    # Registered by spares only: no member yet, nothing runs (the first member makes it
    # running).
    PENDING = "pending"
    RUNNING = "running"
    RESTARTING = "restarting"  # a gang restart is under way
    COMPLETED = "completed"
    FAILED = "failed"  # stopped by the policy (a budget spent, no progress, no checkpoint)
    STOPPED = "stopped"  # stopped by an operator


ACTIVE_STATUSES = frozenset({RunStatus.RUNNING, RunStatus.RESTARTING})
FINAL_STATUSES = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.STOPPED})

# The moves a run's status may make, from each status to the ones it may go to; the store
# refuses any other (``store.registry.set_run_status``).  A run is created pending (spares
# only) or running.  Its first member makes a pending run running; a gang restart (a
# restart during a restart too) makes it restarting, its first step after the restart
# running again; it ends completed, failed (by the policy) or stopped (by an operator),
# and an ended run never moves again.
RUN_TRANSITIONS: dict[RunStatus, frozenset[RunStatus]] = {
    RunStatus.PENDING: frozenset({RunStatus.RUNNING, RunStatus.RESTARTING, RunStatus.STOPPED}),
    RunStatus.RUNNING: frozenset({RunStatus.RESTARTING, RunStatus.COMPLETED, RunStatus.FAILED,
                                  RunStatus.STOPPED}),
    RunStatus.RESTARTING: frozenset({RunStatus.RESTARTING, RunStatus.RUNNING,
                                     RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.STOPPED}),
    RunStatus.COMPLETED: frozenset(),
    RunStatus.FAILED: frozenset(),
    RunStatus.STOPPED: frozenset(),
}


class NodeState(StrEnum):
    """What a node of a run is now, as the supervisor judges it
    (``trainwarden.supervisor.control.node_states``)."""

    STARTING = "starting"  # registered, or its torchrun launched and no step reported yet
    RUNNING = "running"  # a member whose workers train
    STOPPING = "stopping"  # a member whose workers are being stopped (a restart, a stop)
    STOPPED = "stopped"  # a member whose workers are stopped (a restart waiting its turn)
    FAILED = "failed"  # a member whose workers failed; the supervisor decides what next
    WAITING = "waiting"  # a live member standing by: a node rank of the run has no node
    SPARE = "spare"  # a live node that runs nothing and can take a member's node rank
    LOST = "lost"  # silent past the node-lost deadline, or confirmed dead
    REPLACED = "replaced"  # silent, and its node rank went to another node (or a shrink)
    FINISHED = "finished"  # its workers completed, or the run has ended


class Verdict(StrEnum):
    """What the policy made of an exit or a finding it does nothing about (a ``policy.Note``),
    and of an exit it acted on; an exit's verdict is stored with it (``exits.verdict``)."""

    COMPLETED = "completed"  # an agent's workers completed (the run completes once all have)
    FAILURE = "failure"  # the exit was a failure the policy acted on (restart or stop)
    LATE = "late"  # of an earlier attempt than the run's
    IGNORED = "ignored"  # ahead of the run's attempt, or the run is final
    ECHO = "echo"  # the attempt already failed: another sign of the same failure
    ONGOING = "ongoing"  # its incident is already open
    WAIT = "wait"  # not yet: a restart under way, a mismatch too young, a command pending
    NOT_MEMBER = "not_member"  # from a spare, a replaced node or a non-member: recorded only


class ActionKind(StrEnum):
    RESTART = "restart"  # a restart or a rollback (a restart with a resume plan)
    STOP = "stop"


class ActionStatus(StrEnum):
    """restart: queued -> delivered -> restarted -> resumed; stop: queued -> delivered -> done;
    failed when an agent reports its command failed; superseded by a newer decision."""

    QUEUED = "queued"
    DELIVERED = "delivered"
    RESTARTED = "restarted"
    RESUMED = "resumed"
    DONE = "done"
    FAILED = "failed"
    SUPERSEDED = "superseded"


IN_PROGRESS = frozenset({ActionStatus.QUEUED, ActionStatus.DELIVERED, ActionStatus.RESTARTED})


class Actor(StrEnum):
    POLICY = "policy"
    OPERATOR = "operator"
    FLEET = "fleet"  # the scheduler's word (a node it drained or lost), read by control.fleet_sync


class IncidentKind(StrEnum):
    """The incidents the supervisor opens: an agent's crash report, a worker's collective
    timeout, and the detectors' findings of incident severity."""

    CRASH = "crash"
    HANG = FindingKind.HANG.value
    COLLECTIVE_TIMEOUT = "collective_timeout"
    NODE_LOST = FindingKind.NODE_LOST.value
    # Members alive and heard that cannot reach each other (detect.partition): named by the
    # failed rendezvous after the collective timeout it caused.
    PARTITION = "partition"
    STRAGGLER = FindingKind.STRAGGLER.value
    LOSS_SPIKE = FindingKind.LOSS_SPIKE.value
    NONFINITE = FindingKind.NONFINITE.value
    # An agent keeps reporting another attempt than the run's and could not be realigned.
    ATTEMPT_MISMATCH = "attempt_mismatch"
    # The data-parallel replicas' exact parameter fingerprints disagree (a worker's
    # ``replica_mismatch`` event): a flipped bit in memory or arithmetic on the minority's node.
    SDC = "silent_data_corruption"


# What each incident does to training, said once (the policy acts on it, the failure rate
# counts it, the ETTR charges it):
#
# * the failures that interrupt training: the attempt ends and the gang restarts (one per
#   attempt: whichever is seen first decides, the others of the attempt are echoes); the
#   failures of the failure rate;
#   silent data corruption ends its attempt too (a rollback to a checkpoint the replicas
#   agreed on);
INTERRUPTING = frozenset({IncidentKind.CRASH, IncidentKind.HANG, IncidentKind.COLLECTIVE_TIMEOUT,
                          IncidentKind.NODE_LOST, IncidentKind.PARTITION, IncidentKind.SDC})
# * the conditions that stay open while they last, without a restart ...
WATCHED = frozenset({IncidentKind.STRAGGLER, IncidentKind.LOSS_SPIKE, IncidentKind.NONFINITE})
# * ... of which these are answered by a rollback (when rollbacks are enabled), which
#   interrupts training too;
ROLLED_BACK = frozenset({IncidentKind.LOSS_SPIKE, IncidentKind.NONFINITE})
# * and those training goes on through: their cost shows in the steps as it happens.
NEVER_INTERRUPTING = WATCHED - ROLLED_BACK


class IncidentStatus(StrEnum):
    OPEN = "open"
    RESOLVED = "resolved"


class RestartCause(StrEnum):
    """The budget a restart counts against (an operator's counts against none)."""

    CRASH = "crash"
    HANG = "hang"  # collective timeouts too
    NODE_LOST = "node_lost"
    SPIKE = "spike"  # loss spikes and NaN/Inf: the rollback budget
    SDC = "sdc"  # silent data corruption: a rollback to a checkpoint the replicas agreed on
    OPERATOR = "operator"
    # A node joined a run that stood by for a missing one (a spare registered, the lost node
    # came back): the restart that starts training again counts against no budget.
    REPLACE = "replace"
    # A shrunk run grows back to its declared world at a checkpoint (a planned restart):
    # counts against no budget.
    GROW = "grow"
    # A member cut off from the rendezvous host (a network partition) gives its rank to a
    # spare: the collective timeout that the partition caused was counted; this restart
    # counts against no budget (the no-progress rule still bounds a partition that a
    # replacement does not end).
    PARTITION = "partition"


class PresenceEvent(StrEnum):
    """The supervisor's events of when a run's agents ran (its idle time is read from them).

    * ``agent_registered``: an agent process registered (its first start, a restart of the
      agent, a return after the supervisor refused it); details: node, hostname, pid,
      scheduler_job (the scheduler's job it runs in, "" outside one);
    * ``agents_down``: no agent of the run has sent a heartbeat for the node-lost deadline;
      details: ``since``, the newest heartbeat's time (from then on nothing ran);
    * ``agents_up``: after ``agents_down``, a heartbeat came without a registration (the
      agents ran all along, out of reach); details: ``at``, that heartbeat's time."""

    AGENT_REGISTERED = "agent_registered"
    AGENTS_DOWN = "agents_down"
    AGENTS_UP = "agents_up"


class JudgeStage(StrEnum):
    """The shares of an evaluator tick that are judged run by run (a failure in one is that
    run's alone): its exit reports, its actions under way, its workers' failure events, the
    detectors' findings, and the upkeep (checkpoints to protect, attempts, presence)."""

    EXITS = "exits"
    ACTIONS = "actions"
    EVENTS = "events"
    FINDINGS = "findings"
    UPKEEP = "upkeep"


class SupervisorEvent(StrEnum):
    """Events the supervisor records about its own handling of a run (besides the
    ``PresenceEvent`` ones and the detectors' findings of event severity, named by their
    ``FindingKind``).

    * ``judge_failed``: a tick failed to judge the run (details: ``stage``, ``error``); the
      run is retried on every tick, every other run is judged as usual; counted in
      ``trainwarden_evaluator_run_failures_total``;
    * ``judge_recovered``: the first tick that judged it again (details: ``failed_since``);
    * ``supervisor_overloaded``, ``supervisor_overload_ended``: the supervisor fell behind
      and caught up again (``policy.on_overload``);
    * ``attempt_realign``: the supervisor told one agent to relaunch as the run's attempt
      (its reports carried another);
    * ``clock_skew``: an agent's timestamps were too far from the supervisor's clock and
      were replaced (one event per agent an hour, counting them);
    * ``unknown_command_result``: an agent reported on a command not sent to it;
    * ``credentials_revoked``: the run ended, and its agents' credentials were revoked once
      they had the node-lost deadline to report (details: ``agents``);
    * ``membership_changed``: a restart gave node ranks to spares, or moved the rendezvous
      to a new port because the last one was taken (details: ``epoch``, ``replaced``:
      [{node_rank, old, new, why}], ``members``, ``endpoint``, ``moved``);
    * ``waiting_for_node``: a restart found node ranks with no node fit to run and no spare
      left: every member stands by (details: ``waiting``: {node rank: why});
    * ``world_resized``: a restart runs the attempt on another number of nodes: a shrink
      (no spare free, the run accepts fewer nodes) or a grow back (details: ``from``, ``to``,
      ``declared``, ``dropped``: [{node_rank, node, why}], ``members``, ``choice``);
    * ``grow_planned``: a shrunk run has a node free again and grows back at its next
      checkpoint (details: ``epoch``, ``after_step``: the checkpoint must be of a later
      step, ``nodes``);
    * ``requeued``: the run's attempt stood by for a node with no spare free, and its
      scheduler job was put back in the queue without that node (``fleet.requeue``): the
      job's agents register again for the next attempt (details: ``job``, ``attempt``: the
      attempt that waited, ``drained``: the nodes drained first (their agents were trusted
      for the host), ``excluded``: the nodes the job's next allocation may not use,
      ``in_run_only``: the nodes cordoned in this run only, ``commands``: each scheduler
      command with its output; ``command``, ``output``: the first, the requeue itself);
    * ``requeue_refused``: such a requeue was not done, because the scheduler's word about
      the job the run's agents named does not make it the run's (no such job, not running,
      its allocation lacks a node of the run, another run's agents named it too): recorded
      once per attempt and reason (details: ``job``, ``attempt``, the scheduler's answer:
      ``command``, ``ok``, ``output``)."""

    JUDGE_FAILED = "judge_failed"
    JUDGE_RECOVERED = "judge_recovered"
    OVERLOADED = "supervisor_overloaded"
    OVERLOAD_ENDED = "supervisor_overload_ended"
    ATTEMPT_REALIGN = "attempt_realign"
    CLOCK_SKEW = "clock_skew"
    UNKNOWN_COMMAND_RESULT = "unknown_command_result"
    CREDENTIALS_REVOKED = "credentials_revoked"
    MEMBERSHIP_CHANGED = "membership_changed"
    WAITING_FOR_NODE = "waiting_for_node"
    WORLD_RESIZED = "world_resized"
    GROW_PLANNED = "grow_planned"
    REQUEUED = "requeued"
    REQUEUE_REFUSED = "requeue_refused"


class HostState(StrEnum):
    """A node's standing in the health ledger (``trainwarden.supervisor.store.hosts``), keyed
    by the agent's node name.

    * ``healthy``: chosen as a member like any other;
    * ``cordoned``: fenced off on evidence (the policy's rule) or by an operator: replaced at
      the next restart and never chosen as a member while it lasts;
    * ``probation``: an operator uncordoned it; it is healthy again once it passes a
      preflight (never silently), and a failed one cordons it again."""

    HEALTHY = "healthy"
    CORDONED = "cordoned"
    PROBATION = "probation"


class EvidenceKind(StrEnum):
    """What the health ledger records against a node (``detect.node_health`` says which
    failures count as which, and the rule that cordons on them)."""

    INFRA_FAILURE = "infra_failure"  # a crash of the machine's class, a collective timeout
    HANG_CULPRIT = "hang_culprit"  # a hang whose culprit rank on the node did not answer
    STRAGGLER = "straggler"  # a sustained straggler episode of a rank on the node
    ECC = "ecc"  # new uncorrected ECC errors (NVML's volatile count grew)
    XID = "xid"  # new XID errors of the hardware kind the agent reports
    PREFLIGHT_FAILED = "preflight_failed"
    DISK_ERROR = "disk_error"  # a checkpoint save failed on an I/O error of the disk
    SDC = "sdc"  # a rank on the node held parameters its replicas did not (silent corruption)
    PREFLIGHT_PASSED = "preflight_passed"  # not against it: the pass that ended a probation


class HostActionKind(StrEnum):
    """The audited changes of a node's state (``host_actions``)."""

    CORDON = "cordon"  # -> cordoned (the policy's rule, or an operator)
    # A command run on the fleet's scheduler (a drain, a resume), with its output; failed or
    # not: its reason says which.
    FLEET_COMMAND = "fleet_command"
    UNCORDON = "uncordon"  # cordoned -> probation (an operator)
    PROBATION_PASSED = "probation_passed"  # probation -> healthy (a passed preflight)
    # A node cordoned in one run only (evidence from a source not trusted for the host: the
    # run replaces it; no other run is affected).
    RUN_CORDON = "run_cordon"

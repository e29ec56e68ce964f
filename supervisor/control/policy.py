"""The one place that decides.  Pure: facts in, a decision out; no I/O, time passed in.

First version: worker crashes.

* A failed exit (outcome other than "completed", or a non-zero code) of the run's *current*
  attempt opens one incident and gang-restarts the run as attempt + 1, from the newest complete
  checkpoint, after an exponential backoff; when the run's restart budget is spent the run
  fails and every agent is told to stop.
* Exits tagged with an older attempt are late (the other nodes' workers die once a peer died,
  and a restart stops the old group): recorded, never a new failure.  Because a restart moves
  the run to the next attempt at once, the second node's report of the same crash is late by
  construction; there is no time window to tune.
* An exit with outcome "stopped" for the current attempt of a running run was not caused by
  us (our stop/restart commands move the run off that attempt or out of "running") and counts
  as a failure: a node that went away mid-run must not leave the gang half alive.
* The run completes when every agent of the run reported "completed" for the current attempt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from trainwarden.agent.core import rootcause
from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.agent.core.findings import FindingKind, Severity
from trainwarden.agent.core.rootcause import FailureClass
from trainwarden.agent.core.states import CommandStatus, ExitOutcome
from trainwarden.agent.protocol import LRSchedule, ResumePlan
from trainwarden.supervisor.detect import node_health, partition
from trainwarden.supervisor.detect.overload import OverloadConfig
from trainwarden.supervisor.enums import (
    FINAL_STATUSES,
    INTERRUPTING,
    ROLLED_BACK,
    WATCHED,
    Actor,
    HostState,
    IncidentKind,
    PresenceEvent,
    RestartCause,
    RunStatus,
    SupervisorEvent,
    Verdict,
)
from trainwarden.supervisor.fleet import REASON_PREFIX, FleetNode, FleetNodeState
from trainwarden.supervisor.goodput import elastic
from trainwarden.supervisor.goodput.spike_cost import ProgressLost, SpikeCost, weigh


def setting_name(field: str) -> str:
    """The setting a field of ``PolicyConfig`` is set by: ``rollback_X`` is ``rollback.X``,
    the others are ``restart``'s (``restart_budget`` as ``restart.budget``)."""
    if field.startswith("rollback_"):
        return "rollback." + field.removeprefix("rollback_")
    return "restart." + field.removeprefix("restart_")


@dataclass(frozen=True)
class PolicyConfig:
    SECTION: ClassVar[Callable[[str], str]] = setting_name

    # per cause: crash, hang (collective timeouts too), node_lost
    restart_budget: int = bounded(10, ge=0)
    # the first restart waits this long, each next one twice as long
    backoff_s: float = bounded(1.0, ge=0)
    backoff_max_s: float = 60.0  # ... up to this
    # Loss-spike / NaN rollback: to the newest checkpoint at least rollback_margin_steps
    # before the spike, skipping what was observed to be bad and lowering the LR for a while
    # in proportion.  A rollback that costs more than the spike did is a loss of its own.
    rollback_budget: int = bounded(3, ge=0)  # rollbacks per run before it is stopped
    # the checkpoint must be this far before the spike start
    rollback_margin_steps: int = bounded(10, ge=0)
    # The skip runs from the spike's first batch through the batch of the step where it was
    # detected, widened on both sides; it doubles on each recurrence.
    rollback_skip_before: int = bounded(10, ge=0)  # batches skipped before the spike's first batch
    # batches skipped after the one where it was detected
    rollback_skip_after: int = bounded(0, ge=0)
    # a fixed length instead (doubled likewise)
    rollback_skip_batches: int | None = bounded(
        None, ge=1, hint="or leave it unset to skip what was observed")
    # LR x this (squared, cubed... on each recurrence)
    rollback_lr_scale: float = bounded(0.5, gt=0, le=1, hint="e.g. 0.5 halves the LR")
    # LR x scale for rollback_lr_ratio x the batches skipped, then back to 1.0 over half as
    # many steps; rollback_lr_steps / rollback_lr_ramp_steps fix either instead.

    # steps at the lowered LR per batch skipped
    rollback_lr_ratio: float = bounded(0.25, ge=0, hint="0: no LR reduction")
    # a fixed number of steps at the lowered LR instead
    rollback_lr_steps: int | None = bounded(
        None, ge=0, hint="or leave it unset to size it from the skip")
    # a fixed ramp back to 1.0 instead
    rollback_lr_ramp_steps: int | None = bounded(
        None, ge=0, hint="or leave it unset to size it from the skip")
    # A run that restarts this many times in a row without passing its highest step is
    # stopped and flagged, not restarted forever.
    no_progress_restarts: int = bounded(3, ge=1)
    # An agent reporting another attempt than the run's (a restart in progress aside) is told
    # to relaunch as the run's attempt; if that fails, an incident says why.

    # seconds of another attempt before the realign command
    realign_after_s: float = bounded(5.0, ge=0)
    # seconds after that command before an incident opens
    realign_timeout_s: float = bounded(60.0, gt=0)
    # A run whose workers fail twice in a row on the same error in the training script (same
    # exception type raised at the same line of the user's code, whatever the step) is stopped
    # with the traceback on the incident, not restarted until a budget runs out: a
    # deterministic bug does not go away by itself.  Failures of the machine (signals, OOM,
    # NCCL/gloo, a lost node) are retried as before.
    stop_on_repeated_user_error: bool = True
    # A run whose failure repeats identically, whatever its class, is stopped at the second
    # one: the same rank, the same exit code or signal, the same last lines of stderr (its
    # traceback's end, or what it printed last when it left none, as argparse's usage
    # error), in the same phase (before the first step, or at the same step), so with no
    # progress between them.  A third attempt would fail the same way.
    stop_on_identical_failure: bool = True

    def __post_init__(self) -> None:
        check(self)
        cross_check(self.backoff_max_s >= self.backoff_s, self, "backoff_max_s",
                    f">= backoff_s = {self.backoff_s:g}", got=self.backoff_max_s,
                    hint="raise the maximum or lower the base")


# The cause a restart is counted against (each has its own budget).  A collective timeout
# is a hang the collective itself noticed: it counts as one.  This is the cause every restart
# action records, and the ``cause`` label of ``/metrics`` restarts and budgets.
CAUSE_OF_KIND: dict[str, RestartCause] = {
    IncidentKind.CRASH: RestartCause.CRASH, IncidentKind.HANG: RestartCause.HANG,
    IncidentKind.COLLECTIVE_TIMEOUT: RestartCause.HANG,
    IncidentKind.NODE_LOST: RestartCause.NODE_LOST,
    IncidentKind.LOSS_SPIKE: RestartCause.SPIKE, IncidentKind.NONFINITE: RestartCause.SPIKE,
    IncidentKind.SDC: RestartCause.SDC}
BUDGET_CAUSES = (RestartCause.CRASH, RestartCause.HANG, RestartCause.NODE_LOST,
                 RestartCause.SPIKE, RestartCause.SDC)
OPERATOR_CAUSE = RestartCause.OPERATOR  # an operator's restart or rollback: outside budgets


def restart_cause(actor: str | None, cause: str | None) -> str:
    """The cause a restart action counts under: the one the policy recorded on it, or
    "operator" for an operator's action."""
    if actor != Actor.POLICY:
        return OPERATOR_CAUSE
    return cause or RestartCause.CRASH


RESTART_CAUSES = (*BUDGET_CAUSES, OPERATOR_CAUSE, RestartCause.REPLACE, RestartCause.GROW,
                  RestartCause.PARTITION)


@dataclass(frozen=True)
class RestartCounts:
    """A run's restarts: every restart action decided for it (each gang-restarts the
    workers as a new attempt: a crash's or a hang's restart, a spike's rollback, an
    operator's restart or rollback), by the cause it counts under (``restart_cause``).

    ``total`` is the run's "restarts" wherever it is shown (the runs list of the API, the CLI
    and the dashboard, the run page); ``by_cause`` is that count split by cause (the
    ``trainwarden_run_restarts{cause}`` counters); ``automatic`` leaves the operator's out:
    what the budgets count (``budgets_left``)."""

    by_cause: Mapping[str, int]

    @property
    def total(self) -> int:
        return sum(self.by_cause.values())

    @property
    def automatic(self) -> dict[str, int]:
        return {c: n for c, n in self.by_cause.items() if c != OPERATOR_CAUSE}


def restart_counts(history: Iterable[Mapping[str, Any]]) -> RestartCounts:
    """The counts of a run's restart actions (each with its ``actor`` and ``cause``), every
    cause of ``RESTART_CAUSES`` present (0 when none)."""
    by_cause: dict[str, int] = dict.fromkeys(RESTART_CAUSES, 0)
    for a in history:
        cause = restart_cause(a.get("actor"), a.get("cause"))
        by_cause[cause] = by_cause.get(cause, 0) + 1
    return RestartCounts(by_cause=by_cause)


# The rule named on a Stop's incident when a user-code failure repeats.
STOP_REPEATED_USER_ERROR = "repeated_user_error"
# The rule named on a Stop's incident when a failure repeats identically (any class).
STOP_IDENTICAL_FAILURE = "identical_failure"


@dataclass(frozen=True)
class RunFacts:
    id: int
    name: str
    status: str
    attempt: int
    # The automatic restarts so far (the run row's counter: the backoff's exponent), not the
    # run's restarts as shown (``RestartCounts.total``, the operator's included).
    restarts: int


@dataclass(frozen=True)
class ExitFacts:
    id: int
    agent_id: int
    node: str
    attempt: int
    outcome: str
    exit_code: int | None
    signal: int | None
    failed_ranks: list[dict[str, Any]] = field(default_factory=list)
    # Each rank's newest step report of that attempt (to name the step it failed in).
    rank_steps: Mapping[int, int] = field(default_factory=dict)
    # Ranks that reported a distributed error (a peer's connection reset...) in that attempt:
    # when a peer dies the survivors fail too, and torchrun may list one of them first.
    peer_error_ranks: frozenset[int] = frozenset()


@dataclass(frozen=True)
class IncidentSpec:
    kind: str
    cause: str
    attempt: int
    agent_id: int | None = None
    node: str | None = None
    rank: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    step: int | None = None


@dataclass(frozen=True)
class Note:
    """Nothing to do; ``verdict`` says what the exit or finding was (``Verdict``)."""

    verdict: Verdict
    why: str = ""


@dataclass(frozen=True)
class Restart:
    """Gang restart: every agent of the run relaunches as ``attempt``."""

    attempt: int
    checkpoint: str | None
    not_before: float
    reason: str
    actor: str = Actor.POLICY
    incident: IncidentSpec | None = None
    counts_against_budget: bool = True
    collect_stacks: bool = False  # a hang: dump every worker's stacks before the kill
    skip: tuple[tuple[int, int], ...] = ()  # global batch-index ranges never to train
    lr: LRSchedule | None = None  # LR x scale for a while after the resume
    cause: str = RestartCause.CRASH  # the budget it counts against
    rollback_to_step: int | None = None  # a rollback: checkpoints after it are abandoned
    # Give the rank of a member silent past the node-lost deadline to a spare (a lost node's
    # restart, and the one that ends a wait for a node).  Every other restart keeps its
    # members but the cordoned: a node silent too long is judged lost by its own finding.
    replace_lost: bool = False
    # A shrunk run grows back: free spares take the node ranks above its current world.
    grow: bool = False
    # The rendezvous moves to a new port (the membership epoch grows): the last attempt's
    # failed because a port was taken (``rootcause.port_in_use``), and would again.
    move_endpoint: bool = False
    # Nodes confirmed dead before the node-lost deadline (silent, and their peers' workers
    # failed on their connections to them): not fit to run, whatever their last heartbeat.
    lost: frozenset[str] = frozenset()
    # Members cut off from the rendezvous host (a network partition): their ranks go to
    # spares for this restart; they stay alive, and spares of the run from then on.
    cut_off: frozenset[str] = frozenset()

    def plan(self, *, action_id: int) -> dict[str, Any]:
        """The ResumePlan (as its JSON dict) sent with each restart command."""
        p = ResumePlan(checkpoint=self.checkpoint, attempt=self.attempt, skip=self.skip,
                       lr=self.lr, lineage=f"a{self.attempt}", reason=self.reason,
                       action_id=action_id)
        d: dict[str, Any] = json.loads(p.to_json())
        return d


@dataclass(frozen=True)
class Stop:
    """Stop every agent; the run ends as ``status`` (failed when the budget is spent)."""

    status: str
    reason: str
    actor: str = Actor.POLICY
    incident: IncidentSpec | None = None


@dataclass(frozen=True)
class Complete:
    reason: str = "every agent reported completed"


Decision = Note | Restart | Stop | Complete


@dataclass(frozen=True)
class RecoveryFacts:
    """What a restart or rollback decision needs to know about the run's history."""

    # Complete checkpoints of the current lineage (not on an abandoned branch), oldest first.
    checkpoints: tuple[tuple[int, str], ...] = ()
    # step -> global batch index trained at that step (for the steps the decision names).
    batch_index: Mapping[int, int] = field(default_factory=dict)
    restarts_by_cause: Mapping[str, int] = field(default_factory=dict)
    high_step: int | None = None  # the highest step the run has ever reported
    # The run's highest step when each earlier restart was decided, oldest first.
    high_at_restarts: tuple[int | None, ...] = ()
    # The fingerprint (``rootcause.fingerprint``) of the user-code failure that ended the
    # run's previous attempt; None when that attempt ended otherwise.
    previous_failure: str | None = None
    # The signature (``rootcause.signature``) of the failure that ended the run's previous
    # attempt, whatever its class; None when that attempt ended otherwise.
    previous_signature: str | None = None


def budget_of(cause: str, cfg: PolicyConfig) -> int:
    return cfg.rollback_budget if cause == RestartCause.SPIKE else cfg.restart_budget


def budgets_left(restarts_by_cause: Mapping[str, int], cfg: PolicyConfig) -> dict[str, int]:
    """Automatic restarts left in each budget (``BUDGET_CAUSES``) after the ones counted
    against it: what the policy checks and ``/metrics`` exports."""
    return {c: max(0, budget_of(c, cfg) - restarts_by_cause.get(c, 0)) for c in BUDGET_CAUSES}


def restarts_without_progress(high_at_restarts: Sequence[int | None], high_step: int | None
                              ) -> int:
    """The newest automatic restarts in a row since which the run has not passed its highest
    step: those decided when the run's high was already ``high_step`` (the high only grows,
    so a restart after which the run went further ends the streak).  At
    ``no_progress_restarts`` the next failure stops the run; ``/metrics`` exports this number
    and the ``TrainwardenRunNoProgress`` alert compares it with that same setting."""
    if high_step is None:
        return 0
    streak = 0
    for high in reversed(high_at_restarts):
        if high is None or high < high_step:
            break
        streak += 1
    return streak


def budget_left(cause: str, run: RunFacts, rec: RecoveryFacts | None, cfg: PolicyConfig
                ) -> tuple[bool, str]:
    """(may restart, why not) for a restart counted against ``cause``."""
    if cause == OPERATOR_CAUSE:
        return True, ""
    if rec is None:  # no history given: the run's total restarts against the crash budget
        left = max(0, cfg.restart_budget - run.restarts)
    else:
        left = budgets_left(rec.restarts_by_cause, cfg).get(cause, budget_of(cause, cfg))
    if left <= 0:
        what = "rollback" if cause == RestartCause.SPIKE else f"restart ({cause})"
        return False, f"{what} budget of {budget_of(cause, cfg)} spent"
    if rec is not None:
        n = cfg.no_progress_restarts
        if restarts_without_progress(rec.high_at_restarts, rec.high_step) >= n:
            return False, (f"no progress: {n} restarts in a row without passing step "
                           f"{rec.high_step}")
    return True, ""


def backoff_s(restarts_so_far: int, cfg: PolicyConfig) -> float:
    """Exponential: base, 2 x base, 4 x base, ... capped at the maximum."""
    return min(cfg.backoff_s * (2.0 ** min(restarts_so_far, 60)), cfg.backoff_max_s)


def describe_exit(ex: ExitFacts) -> tuple[str, int | None, int | None, int | None]:
    """Cause text plus the (rank, exit code, signal) of the failed rank to blame: torchrun's
    root cause, unless it reported a distributed error and another failed rank did not (the
    survivor of a peer's death fails on the broken connection, sometimes first)."""
    culprits = sorted(ex.failed_ranks,  # stable: torchrun's order among equals
                      key=lambda f: _int_or_none(f.get("rank")) in ex.peer_error_ranks)
    first = culprits[0] if culprits else {}
    rank = _int_or_none(first.get("rank"))
    code = _int_or_none(first.get("exit_code"))
    sig = _int_or_none(first.get("signal"))
    if code is None and sig is None:
        code, sig = ex.exit_code, ex.signal
    where = f"node {ex.node}" + (f" rank {rank}" if rank is not None else "")
    if sig:
        what = f"killed by signal {sig}"
    elif code is not None:
        what = f"exited with code {code}"
    else:
        what = f"ended ({ex.outcome})"
    msg = first.get("message")
    if isinstance(msg, str) and msg.startswith(rootcause.TORCHRUN_HINT):
        msg = None  # an older agent's copy of torchrun's hint: it says nothing of the failure
    who = "torchrun" if first.get("launcher") is True else "worker"
    cause = f"{who} on {where} {what}" + (f": {msg}" if msg else "")
    rc = rootcause.from_dict(first.get("root_cause"))
    if rc is not None:  # the exception and where first: what the person paged reads
        cause = f"{rootcause.headline(rc, rank=rank, host=rc.host or ex.node)}; " \
                f"{who} on {where} {what}"
    disk = rootcause.storage_failure(rc)
    if disk is not None and not sig:  # (a restart does not free a disk: say it first)
        cause = f"checkpoint {disk} on node {ex.node}: {cause}"
    if ex.outcome == ExitOutcome.STOPPED:
        cause = f"worker group on node {ex.node} was stopped outside the supervisor ({what})"
    return cause, rank, code, sig


@dataclass(frozen=True)
class CrashCause:
    """What an exit's blamed rank left: its root cause, whose fault, the fingerprint of a
    failure of the user's code (None for any other), and the failure's signature with the
    words that say what it is made of (``identity``)."""

    root_cause: rootcause.RootCause | None
    failure_class: FailureClass
    fingerprint: str | None
    signature: str | None = None
    identity: str = ""

    def details(self) -> dict[str, Any]:
        """The incident's details: the traceback tail is in ``root_cause``."""
        return {"root_cause": None if self.root_cause is None else self.root_cause.as_dict(),
                "failure_class": str(self.failure_class), "fingerprint": self.fingerprint,
                "signature": self.signature}


def failure_phase(ex: ExitFacts, step: int | None) -> str:
    """When the attempt failed: before its first step (no rank reported one), or the step."""
    return "before the first step" if not ex.rank_steps or step is None else f"at step {step}"


def crash_cause(ex: ExitFacts, rank: int | None, code: int | None, sig: int | None,
                phase: str = "") -> CrashCause:
    """The root cause of the rank ``describe_exit`` blamed, classified, fingerprinted and
    signed (``phase``: ``failure_phase``).  A launcher's own failure (torchrun's rendezvous)
    is not signed: where the rendezvous forms is the membership's to change.

    The ranks signed: the blamed one where what it left is its own (a traceback), else every
    rank the exit names (the node's): unprefixed stderr is the whole node's, and which of its
    ranks torchrun names first is a race (two ranks rejecting the same argument)."""
    first = next((f for f in ex.failed_ranks if _int_or_none(f.get("rank")) == rank), None)
    rc = rootcause.from_dict(first.get("root_cause")) if first is not None else None
    ranks = [rank] if rank is not None else []
    if rc is not None and not rootcause.has_traceback(rc):
        ranks = sorted({r for f in ex.failed_ranks if (r := _int_or_none(f.get("rank")))
                        is not None})
    sign = None if rank is None else rootcause.signature(
        rc, ranks=ranks, exit_code=code, signal=sig, phase=phase)
    what = f"signal {sig}" if sig else f"exit code {code}"
    lines = "traceback" if rootcause.has_traceback(rc) else "last lines of stderr"
    who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
    return CrashCause(rc, rootcause.classify(rc, exit_code=code, signal=sig),
                      rootcause.fingerprint(rc, exit_code=code, signal=sig), sign,
                      f"{who}, {what}, the same {lines}, {phase}")


def _rendezvous_port_taken(cause: CrashCause | None) -> bool:
    """The failure is torch.distributed's socket failing to listen on a taken port (the
    rendezvous store's); a port the script's own code could not take is the script's
    business, and moving the rendezvous would not help it."""
    return (cause is not None and cause.failure_class == FailureClass.MACHINE
            and rootcause.port_in_use(cause.root_cause))


def repeated_user_error(cause: CrashCause, recovery: RecoveryFacts | None, cfg: PolicyConfig
                        ) -> bool:
    """The rule: the same failure of the user's code ended the previous attempt too."""
    return (cfg.stop_on_repeated_user_error and cause.fingerprint is not None
            and recovery is not None and recovery.previous_failure == cause.fingerprint)


def identical_failure(cause: CrashCause, recovery: RecoveryFacts | None, cfg: PolicyConfig
                      ) -> bool:
    """The rule: the previous attempt ended with a failure of the same signature."""
    return (cfg.stop_on_identical_failure and cause.signature is not None
            and recovery is not None and recovery.previous_signature == cause.signature)


def _int_or_none(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def exit_incident(ex: ExitFacts) -> tuple[IncidentSpec, CrashCause | None]:
    """The incident one failed exit opens (a crash, or a hang the agent's watchdog ended),
    with the crash's cause (None for a hang)."""
    cause, rank, code, sig = describe_exit(ex)
    kind = IncidentKind.CRASH
    if ex.outcome == ExitOutcome.HUNG:  # the agent's own watchdog acted while we were away
        kind = IncidentKind.HANG
        cause = f"no step progress on node {ex.node}; the agent's watchdog killed the workers"
    # The step it failed in: the one after the failed rank's newest report (after the
    # newest of any rank when the exit names none).
    last = ex.rank_steps.get(rank) if rank is not None else None
    if last is None and ex.rank_steps:
        last = max(ex.rank_steps.values())
    incident = IncidentSpec(
        kind=kind, cause=cause, attempt=ex.attempt, agent_id=ex.agent_id, node=ex.node,
        rank=rank, exit_code=code, signal=sig, step=None if last is None else last + 1,
        details={"outcome": ex.outcome, "exit_code": ex.exit_code, "signal": ex.signal,
                 "failed_ranks": ex.failed_ranks},
    )
    if kind != IncidentKind.CRASH:
        return incident, None
    crash = crash_cause(ex, rank, code, sig, failure_phase(ex, incident.step))
    return replace(incident, details={**incident.details, **crash.details()}), crash


def reattribute(incident: Mapping[str, Any], ex: ExitFacts) -> IncidentSpec | None:
    """Another node's exit for the attempt a crash incident ended, arriving after it: when
    the incident blamed a rank that only lost its peer (a survivor of another node's death)
    and this exit names a rank that failed of itself, the incident names that one instead
    (the node at fault, for the user and for the health ledger).  None: it stays as it is."""
    if incident.get("kind") != IncidentKind.CRASH or ex.outcome != ExitOutcome.CRASHED:
        return None
    if not node_health.lost_peer(incident.get("details") or {}):
        return None
    spec, _ = exit_incident(ex)
    if spec.rank is None or node_health.lost_peer(spec.details):
        return None
    return spec


def on_exit(
    run: RunFacts,
    ex: ExitFacts,
    *,
    agent_ids: frozenset[int],
    completed_agent_ids: frozenset[int],
    checkpoint: str | None,
    cfg: PolicyConfig,
    now: float,
    restart_pending: bool = False,
    recovery: RecoveryFacts | None = None,
    silent_peers: Mapping[str, float] | None = None,
    may_wait: bool = False,
    rendezvous: RendezvousFacts | None = None,
) -> Decision:
    """Decide what one agent's exit report means for the run.

    ``restart_pending``: the restart to the run's current attempt has not relaunched any
    worker yet.  Then the previous attempt is still the one training, and its completion
    completes the run (the restart, decided on a late or false signal, is moot).

    ``silent_peers``: the run's other members silent for longer than the confirmation time
    (node -> seconds since heard).  An exit whose workers failed on a lost peer connection
    while a peer is silent is that peer's death, confirmed (``node_death``): one node-lost
    incident naming it and one restart that replaces it, never a crash of the survivor.
    ``may_wait``: such an exit is young enough to be held while no peer is silent yet.

    ``rendezvous``: where the attempt's rendezvous formed; a member that could not reach it
    while its host is heard is cut off by a network partition (``network_partition``)."""
    if (ex.attempt == run.attempt - 1 and restart_pending and ex.outcome == ExitOutcome.COMPLETED
            and not ex.exit_code and run.status not in FINAL_STATUSES):
        if agent_ids <= (completed_agent_ids | {ex.agent_id}):
            return Complete(reason=f"every agent completed attempt {ex.attempt} before the "
                                   f"restart to attempt {run.attempt} reached it")
        return Note(Verdict.COMPLETED, "waiting for the other agents to complete")
    if ex.attempt < run.attempt:
        return Note(Verdict.LATE, f"exit of attempt {ex.attempt}; the run is at {run.attempt}")
    if ex.attempt > run.attempt:
        return Note(Verdict.IGNORED,
                    f"exit of attempt {ex.attempt} ahead of the run ({run.attempt})")
    if run.status in FINAL_STATUSES:
        return Note(Verdict.IGNORED, f"run is {run.status}")
    if ex.outcome == ExitOutcome.COMPLETED and not ex.exit_code:
        if agent_ids <= (completed_agent_ids | {ex.agent_id}):
            return Complete()
        return Note(Verdict.COMPLETED, "waiting for the other agents to complete")
    incident, crash = exit_incident(ex)
    kind, cause = incident.kind, incident.cause
    if incident.kind == IncidentKind.CRASH and rendezvous is not None:
        split = network_partition(run, ex, incident, crash, rendezvous=rendezvous,
                                  silent=silent_peers or {}, may_wait=may_wait,
                                  checkpoint=checkpoint, cfg=cfg, now=now, recovery=recovery)
        if split is not None:
            return split
    if incident.kind == IncidentKind.CRASH and node_health.lost_peer(incident.details):
        death = node_death(run, ex, incident, silent=silent_peers or {}, may_wait=may_wait,
                           checkpoint=checkpoint, cfg=cfg, now=now, recovery=recovery)
        if death is not None:
            return death
    if crash is not None and repeated_user_error(crash, recovery, cfg):
        reason = (f"the same error in the training script ended two attempts in a row "
                  f"(a bug in the script, not restarted again): {cause}")
        return Stop(status=RunStatus.FAILED, reason=reason, incident=replace(
            incident, details={**incident.details, "stop_rule": STOP_REPEATED_USER_ERROR}))
    if crash is not None and identical_failure(crash, recovery, cfg):
        reason = (f"the same failure ended two attempts in a row with no progress between "
                  f"them ({crash.identity}); not restarted again: {cause}")
        return Stop(status=RunStatus.FAILED, reason=reason, incident=replace(
            incident, details={**incident.details, "stop_rule": STOP_IDENTICAL_FAILURE}))
    may, why = budget_left(CAUSE_OF_KIND[kind], run, recovery, cfg)
    if not may:
        return Stop(status=RunStatus.FAILED, reason=f"{why}; last failure: {cause}",
                    incident=incident)
    wait = backoff_s(run.restarts, cfg)
    return Restart(
        attempt=run.attempt + 1,
        checkpoint=checkpoint,
        not_before=now + wait,
        reason=f"gang restart after {kind}: {cause}",
        incident=incident,
        cause=CAUSE_OF_KIND[kind],
        move_endpoint=_rendezvous_port_taken(crash),
    )


@dataclass(frozen=True)
class RendezvousFacts:
    """The attempt's rendezvous: the node hosting it (node rank 0's; None: none yet)."""

    host: str | None


def network_partition(run: RunFacts, ex: ExitFacts, failure: IncidentSpec,
                      crash: CrashCause | None, *, rendezvous: RendezvousFacts,
                      silent: Mapping[str, float], may_wait: bool, checkpoint: str | None,
                      cfg: PolicyConfig, now: float, recovery: RecoveryFacts | None = None
                      ) -> Decision | None:
    """A failed rendezvous read as a partition (``detect.partition``).  A member whose
    torchrun could not reach the rendezvous host, while the supervisor hears the host, is
    cut off: one partition incident names it and the host, and one restart gives its rank
    to a spare (none free: the rank waits, saying why).  That restart counts against no
    budget (the collective timeout the partition caused before it was counted); the
    no-progress rule still bounds it.  The host's own failure (its members did not join)
    names no one: it is held a while (``may_wait``) for the member's report, then judged as
    a crash.  None: not a partition."""
    rc = crash.root_cause if crash is not None else None
    split = partition.cut_off(ex.node, rc, host=rendezvous.host, silent=silent)
    if split is None:
        joined = partition.not_joined(rc)
        if joined is not None and ex.node == rendezvous.host and not silent and may_wait:
            return Note(Verdict.WAIT, f"the rendezvous on {ex.node} formed with {joined[0]} of "
                                      f"{joined[1]} nodes: waiting for the report of a member "
                                      "that did not join")
        return None
    cause = f"{split.message}; {failure.cause}"
    incident = replace(failure, kind=IncidentKind.PARTITION, cause=cause, details={
        **failure.details, "partition": {"cut_off": split.cut_off,
                                         "unreachable": split.unreachable,
                                         "endpoint": split.endpoint, "why": split.why}})
    may, why = budget_left(RestartCause.PARTITION, run, recovery, cfg)
    if not may:
        return Stop(status=RunStatus.FAILED, reason=f"{why}; last failure: {cause}",
                    incident=incident)
    return Restart(attempt=run.attempt + 1, checkpoint=checkpoint,
                   not_before=now + backoff_s(run.restarts, cfg),
                   reason=f"gang restart after a network partition: {split.cut_off} cannot "
                          f"reach {split.unreachable}, the rendezvous host; {split.cut_off} "
                          "is replaced", incident=incident, cause=RestartCause.PARTITION,
                   counts_against_budget=False, cut_off=frozenset({split.cut_off}))


def node_death(run: RunFacts, ex: ExitFacts, survivor: IncidentSpec, *,
               silent: Mapping[str, float], may_wait: bool, checkpoint: str | None,
               cfg: PolicyConfig, now: float, recovery: RecoveryFacts | None = None
               ) -> Decision | None:
    """A survivor's failure on a lost peer connection, read with the other members'
    silence.  A silent peer is dead, confirmed by both: its node is lost now (the incident
    names it and quotes the survivor's error as its consequence; one restart, counted once
    against the node-lost budget, gives its rank to a spare).  No peer silent yet: hold the
    exit a while (``may_wait``), since the dead node's silence grows from the moment it
    died; then it is an ordinary crash (None)."""
    if not silent:
        if may_wait:
            return Note(Verdict.WAIT, f"the workers on {ex.node} lost a peer connection: "
                                      "waiting to see whether a peer node went silent")
        return None
    dead = sorted(silent)
    quiet = ", ".join(f"{n} silent for {silent[n]:.1f} s" for n in dead)
    cause = (f"node {', '.join(dead)} lost: {quiet}, and the workers on {ex.node} failed on "
             f"their connection to it ({survivor.cause})")
    incident = IncidentSpec(
        kind=IncidentKind.NODE_LOST, cause=cause, attempt=ex.attempt, node=dead[0], rank=None,
        details={"confirmed_by": "peer_connection", "silent_s": dict(silent),
                 "lost": dead, "survivor": {"node": ex.node, "cause": survivor.cause,
                                            "rank": survivor.rank}})
    restart_cause = CAUSE_OF_KIND[IncidentKind.NODE_LOST]
    may, why = budget_left(restart_cause, run, recovery, cfg)
    if not may:
        return Stop(status=RunStatus.FAILED, reason=f"{why}; last failure: {cause}",
                    incident=incident)
    return Restart(attempt=run.attempt + 1, checkpoint=checkpoint,
                   not_before=now + backoff_s(run.restarts, cfg),
                   reason=f"gang restart after node lost: {cause}", incident=incident,
                   cause=restart_cause, replace_lost=True, lost=frozenset(dead))


def on_node_joined(run: RunFacts, *, joined: Sequence[str], checkpoint: str | None,
                   now: float) -> Restart:
    """The run stood by for a missing node and one is fit to run now (a spare registered,
    the lost node came back): restart the gang on it at once.  Counts against no budget (the
    loss was counted when it happened)."""
    why = (f"{', '.join(joined)} can take the missing node rank(s)" if joined
           else "the run goes on with fewer nodes")
    return Restart(attempt=run.attempt + 1, checkpoint=checkpoint, not_before=now,
                   reason=f"gang restart: {why}", cause=RestartCause.REPLACE,
                   counts_against_budget=False, replace_lost=True)


def on_grow(run: RunFacts, *, joined: Sequence[str], world: int, declared: int,
            checkpoint: str | None, step: int | None, now: float) -> Restart:
    """A shrunk run has nodes free again and saved a checkpoint since: restart the gang from
    that checkpoint on the declared world (a planned restart, never in the middle of a step;
    counts against no budget)."""
    at = f" at the checkpoint of step {step}" if step is not None else ""
    return Restart(attempt=run.attempt + 1, checkpoint=checkpoint, not_before=now,
                   reason=f"grow back from {world} to {declared} nodes{at}: "
                          f"{', '.join(joined)} free", cause=RestartCause.GROW,
                   counts_against_budget=False, grow=True, replace_lost=True)


@dataclass(frozen=True)
class ElasticFigures:
    """The run's own figures the choice between shrinking and waiting reads (None: not
    measured yet; the documented assumption is used and said)."""

    step_s: float | None = None  # a step's time, the newest steps
    restart_s: float | None = None  # a restart's decision to its first step, mean
    interval_s: float | None = None  # between two checkpoints of one attempt, mean


# What an unmeasured figure is taken as (said in the reason when used).
ASSUMED_STEP_S = 1.0
ASSUMED_RESTART_S = 60.0
ASSUMED_INTERVAL_S = 600.0


@dataclass(frozen=True)
class ResizeChoice:
    """Whether a restart that finds a node rank with no node fit to run (and no free spare)
    goes on with fewer nodes, and why (the restart's reason carries it)."""

    shrink: bool
    reason: str


def choose_shrink(*, declared: int, world: int, fit: int, min_nodes: int | None,
                  figures: ElasticFigures | None = None) -> ResizeChoice:
    """Shrink to the ``fit`` members, or wait for a node: only within the run's
    ``min_nodes``, and then by the training each option is expected to lose
    (``goodput.elastic.choose``, from the run's own step, restart and checkpoint times; a
    lost node's return time is unknown)."""
    if min_nodes is None or min_nodes >= world:
        return ResizeChoice(False, f"the run accepts no fewer than {world} nodes "
                                   "(trainwarden agent --min-nodes): it waits for a node")
    if fit < min_nodes:
        return ResizeChoice(False, f"only {fit} node(s) fit to run, fewer than the "
                                   f"{min_nodes} the run accepts (--min-nodes): it waits for "
                                   "a node")
    f = figures or ElasticFigures()
    assumed = [name for name, v in (("step", f.step_s), ("restart", f.restart_s),
                                    ("checkpoint interval", f.interval_s)) if v is None]
    loss = elastic.NodeLoss(
        nodes=declared, live_nodes=fit, min_nodes=min_nodes,
        step_s=f.step_s if f.step_s is not None and f.step_s > 0 else ASSUMED_STEP_S,
        restart_s=f.restart_s if f.restart_s is not None else ASSUMED_RESTART_S,
        to_checkpoint_s=(f.interval_s if f.interval_s is not None else ASSUMED_INTERVAL_S) / 2)
    c = elastic.choose(loss)
    said = (f" (not measured yet, so assumed: {', '.join(assumed)} time)"
            if assumed else "")
    return ResizeChoice(c.choice == "shrink", f"no spare is free: {c.reason}{said}")


def on_member_cordoned(run: RunFacts, *, cordoned: Sequence[str], pending: ResumePlan,
                       now: float) -> Restart:
    """A member of a restart that has not resumed yet was cordoned (the failure that caused
    the restart was the evidence): restart again at once with the same plan (checkpoint,
    skips, LR), so a spare takes its rank before the attempt trains.  Counts against no
    budget (the failure was counted)."""
    return Restart(attempt=run.attempt + 1, checkpoint=pending.checkpoint, not_before=now,
                   reason=f"gang restart: {', '.join(cordoned)} cordoned before the attempt "
                          "trained", cause=RestartCause.REPLACE, counts_against_budget=False,
                   skip=pending.skip, lr=pending.lr)


def corrupting(cordon_reason: str) -> bool:
    """Whether a cordon's reason (``on_host_evidence``'s) is the silent-data-corruption
    rule's: the node corrupted its replicas' state again within the window."""
    return cordon_reason.startswith(f"cordon.{node_health.SDC_RULE}: ")


def on_corrupting_member(run: RunFacts, *, cordoned: Mapping[str, str], pending: ResumePlan
                         ) -> Stop:
    """A member of a restart that has not resumed yet was cordoned for silent data
    corruption (the corruption that caused the restart was the second on that node within
    the window) and no free spare takes its node rank: the run is stopped, failed, rather than
    rolled back again onto a machine known to corrupt its state (where a third rollback would
    end as the second did).  The reason names the cordon and the checkpoint to resume from on
    healthy nodes."""
    said = "; ".join(f"{node} is cordoned for silent data corruption ({why})"
                     for node, why in sorted(cordoned.items()))
    where = (f"resume from {pending.checkpoint}, the newest checkpoint the replicas agreed on"
             if pending.checkpoint else "no checkpoint the replicas agreed on to resume from")
    return Stop(status=RunStatus.FAILED,
                reason=f"{said}, and no free spare can take its node rank: the run is stopped "
                       "rather than rolled back onto a machine that corrupts its state again; "
                       f"{where}, on healthy nodes")


def operator_restart(
    run: RunFacts, *, checkpoint: str | None, reason: str, actor: str, now: float,
    step: int | None = None,
) -> Decision:
    """A restart asked for by an operator: no backoff, not counted against the budget.
    ``step``: the step of a checkpoint the operator named; the branch beyond it is abandoned
    (the newest checkpoint is the highest step of the current lineage, so the old branch's
    later saves must not be taken for the newest again)."""
    if run.status in FINAL_STATUSES:
        return Note(Verdict.IGNORED, f"run is {run.status}")
    return Restart(attempt=run.attempt + 1, checkpoint=checkpoint, not_before=now,
                   reason=reason or "operator restart", actor=actor,
                   counts_against_budget=False, rollback_to_step=step)


def operator_stop(run: RunFacts, *, reason: str, actor: str) -> Decision:
    if run.status in FINAL_STATUSES:
        return Note(Verdict.IGNORED, f"run is {run.status}")
    return Stop(status=RunStatus.STOPPED, reason=reason or "operator stop", actor=actor)


# ---------------------------------------------------------------------------------------------
# Findings of the detectors

# Failures that end the attempt: the gang restarts.  One attempt fails once: whichever of
# these is seen first for an attempt decides, the others of the same attempt are echoes.
RESTART_KINDS = INTERRUPTING
# Incidents that stay open while the condition lasts, without a restart.
WATCH_KINDS = WATCHED
# Incidents answered by a rollback (when rollbacks are enabled).
ROLLBACK_KINDS = ROLLED_BACK


@dataclass(frozen=True)
class OpenIncident:
    """Record an incident and act no further (an alert fires from the metrics)."""

    incident: IncidentSpec


@dataclass(frozen=True)
class RecordEvent:
    """A finding that is worth a row and an alert but not an incident."""

    name: str
    message: str
    step: int | None = None
    rank: int | None = None
    details: dict[str, Any] = field(default_factory=dict)


FindingDecision = Note | Restart | Stop | OpenIncident | RecordEvent


def on_agents_gone(*, since: float, deadline_s: float) -> RecordEvent:
    """No agent of the run has sent a heartbeat for the node-lost deadline: from ``since``
    (the newest heartbeat) nothing ran, which the goodput counts as idle until an agent
    registers or is heard from again.  An event only: what to do about the lost nodes is
    the node-lost incident's business."""
    return RecordEvent(
        name=PresenceEvent.AGENTS_DOWN,
        message=f"no agent of the run has sent a heartbeat for {deadline_s:g} s: nothing "
                "runs until one is back (idle time)",
        details={"since": since, "deadline_s": deadline_s})


def on_agents_back(*, at: float) -> RecordEvent:
    """After ``on_agents_gone``, a heartbeat came without a registration (the agents ran
    all along, out of the supervisor's reach): the idle time ends ``at`` it."""
    return RecordEvent(name=PresenceEvent.AGENTS_UP,
                       message="an agent of the run is heard from again",
                       details={"at": at})


def advised_batch_interval(*, last_overloaded_at: float | None, now: float,
                           sending_agents: int, cfg: OverloadConfig) -> float | None:
    """The batch interval the ingest reply asks agents to use (None: their own, ~1 s).

    * While the supervisor is behind, and ``cfg.backoff_hold_s`` after (so a recovery is not
      undone at once by the load coming back): ``cfg.batch_interval_s``.
    * Whenever more agents send than ``cfg.max_batches_per_s`` batches a second would
      allow at one batch each a second: agents / that limit (2,048 agents at 500 a second:
      every 4.1 s), so the request rate stays bounded however many nodes a run has.

    Fewer, larger batches: the same rows in a fraction of the requests; nothing is dropped,
    and urgent reports (an exit, a crash) still go at once."""
    every = None
    if last_overloaded_at is not None and now - last_overloaded_at <= cfg.backoff_hold_s:
        every = cfg.batch_interval_s
    if cfg.max_batches_per_s > 0 and sending_agents > cfg.max_batches_per_s:
        share = math.ceil(10 * sending_agents / cfg.max_batches_per_s) / 10
        every = max(every or 0.0, share)
    return every


def on_overload(*, reason: str | None, lateness_s: float | None,
                ended_after_s: float | None) -> RecordEvent:
    """What an overload of the supervisor means for each active run: an event, never an
    incident or a restart (the supervisor's backlog is not the run's fault); the hang,
    node-lost and straggler verdicts are held back meanwhile (``Evaluator._judge_overload``)."""
    if ended_after_s is not None:
        return RecordEvent(
            name=SupervisorEvent.OVERLOAD_ENDED,
            message=f"the supervisor keeps up again after {ended_after_s:.1f} s overloaded; "
                    "hang and node-lost deadlines count from now",
            details={"overloaded_s": round(ended_after_s, 3)})
    return RecordEvent(
        name=SupervisorEvent.OVERLOADED,
        message=f"the supervisor is overloaded ({reason}): hang, node-lost and straggler "
                "verdicts are held back until it keeps up; nothing is restarted for it",
        details={"reason": reason or "", "lateness_s": lateness_s})


@dataclass(frozen=True)
class FindingFacts:
    """A detector's finding (or a worker's distributed-failure event), as the policy sees it."""

    kind: str
    severity: Severity
    message: str
    attempt: int
    step: int | None = None
    rank: int | None = None
    node: str | None = None
    details: dict[str, Any] = field(default_factory=dict)
    # When the condition began (unix time), where the detector knows it: a loss spike's first
    # step's time.  Kept on a spike's or NaN's incident (``details["started_at"]``): the
    # fault time of a fault the workers trained through, which no exit report dates.
    started_at: float | None = None
    # From a member of the run (False: a spare's, a replaced node's or a non-member's event,
    # recorded and never acted on).
    member: bool = True


def on_finding(run: RunFacts, f: FindingFacts, *, incident_kinds_this_attempt: frozenset[str],
               open_watch: frozenset[tuple[str, int | None]], checkpoint: str | None,
               cfg: PolicyConfig, now: float, recovery: RecoveryFacts | None = None,
               waiting_for: frozenset[str] = frozenset()) -> FindingDecision:
    """Decide what one finding means.

    ``incident_kinds_this_attempt``: kinds of the incidents already opened for the run's
    current attempt (open or resolved); ``open_watch``: (kind, rank) of the open watch
    incidents (straggler, loss spike), so one episode is one incident, never a flood;
    ``waiting_for``: the missing nodes the current attempt stands by for (no spare was
    left): their silence is already answered, never restarted into again.  Only members move
    a run: a non-member's finding is a note."""
    if not f.member:
        return Note(Verdict.NOT_MEMBER, f"from {f.node or 'a node'}, not a member of the run: "
                                        "recorded, not acted on")
    if f.attempt != run.attempt:
        return Note(Verdict.LATE, f"finding of attempt {f.attempt}; the run is at {run.attempt}")
    if run.status in FINAL_STATUSES:
        return Note(Verdict.IGNORED, f"run is {run.status}")
    if f.kind == IncidentKind.NODE_LOST and f.node in waiting_for:
        return Note(Verdict.WAIT, f"node {f.node} is lost and no spare is left: the members "
                                  "stand by until it or a spare joins")
    cost = spike_cost_of(f, recovery, cfg)
    if cost is not None:
        # Both figures on the record: what the spike cost, what a rollback costs.
        f = replace(f, message=f"{f.message}; {cost.summary()}",
                                details={**f.details, "spike_cost": cost.as_details()})
    if f.severity != Severity.INCIDENT:
        return RecordEvent(name=f.kind, message=f.message, step=f.step, rank=f.rank,
                           details=f.details)
    details = {**f.details, "message": f.message}
    if f.kind in ROLLBACK_KINDS and f.started_at is not None and math.isfinite(f.started_at):
        # the time of the spike's first step (a lost node's last heartbeat is in its details)
        details["started_at"] = f.started_at
    incident = IncidentSpec(kind=f.kind, cause=f.message, attempt=f.attempt, node=f.node,
                            rank=f.rank, details=details, step=f.step)
    if f.kind == IncidentKind.SDC:
        if incident_kinds_this_attempt & (RESTART_KINDS | ROLLBACK_KINDS):
            return Note(Verdict.ECHO, f"attempt {f.attempt} already failed")
        return rollback_for_sdc(run, f, incident, recovery or RecoveryFacts(), cfg, now)
    if f.kind in RESTART_KINDS:
        if incident_kinds_this_attempt & RESTART_KINDS:
            return Note(Verdict.ECHO, f"attempt {f.attempt} already failed")
        may, why = budget_left(CAUSE_OF_KIND[f.kind], run, recovery, cfg)
        if not may:
            return Stop(status=RunStatus.FAILED, reason=f"{why}; last failure: {f.message}",
                        incident=incident)
        return Restart(attempt=run.attempt + 1, checkpoint=checkpoint,
                       not_before=now + backoff_s(run.restarts, cfg),
                       reason=f"gang restart after {f.kind.replace('_', ' ')}: {f.message}",
                       incident=incident, collect_stacks=f.kind == IncidentKind.HANG,
                       cause=CAUSE_OF_KIND[f.kind], replace_lost=f.kind == IncidentKind.NODE_LOST)
    if f.kind in ROLLBACK_KINDS and cfg.rollback_budget > 0 and recovery is not None:
        if incident_kinds_this_attempt & (RESTART_KINDS | ROLLBACK_KINDS):
            return Note(Verdict.ECHO, f"attempt {f.attempt} already failed")
        return rollback_for_spike(run, f, incident, recovery, cfg, now)
    key = (f.kind, f.rank if f.kind == IncidentKind.STRAGGLER else None)
    if key in open_watch:
        return Note(Verdict.ONGOING, f"{f.kind} incident already open")
    if f.kind == IncidentKind.NONFINITE and (IncidentKind.NONFINITE, None) in open_watch:
        return Note(Verdict.ONGOING, "nonfinite incident already open")
    return OpenIncident(incident=incident)


def spike_cost_of(f: FindingFacts, rec: RecoveryFacts | None, cfg: PolicyConfig
                  ) -> SpikeCost | None:
    """A loss spike's cost (``details["progress_lost"]``, the observer's figure) against a
    rollback's: to the checkpoint ``rollback_for_spike`` would load, skipping what it would
    skip, with the run's measured restart time (``details["restart_s"]``).  None for other
    findings, or when the observer had no figure."""
    p = f.details.get("progress_lost")
    if (f.kind not in (IncidentKind.LOSS_SPIKE, FindingKind.LOSS_SPIKE_TRANSIENT)
            or rec is None or not isinstance(p, dict) or f.step is None):
        return None
    try:
        progress = ProgressLost(**p)
    except TypeError:
        return None
    restart_s = f.details.get("restart_s")
    restart_s = float(restart_s) if isinstance(restart_s, int | float) else None
    good = [s for s, _ in rec.checkpoints if s <= f.step - cfg.rollback_margin_steps]
    if not good:
        return weigh(progress, checkpoint_step=None, restart_s=restart_s)
    detected = _int_or_none(f.details.get("detected_at_step")) or progress.now_step
    done = rec.restarts_by_cause.get(RestartCause.SPIKE, 0)
    ((first, last),), _ = rollback_plan(f.step, max(f.step, detected), good[-1], rec, cfg,
                                        done)
    return weigh(progress, checkpoint_step=good[-1], skipped_batches=last - first + 1,
                 restart_s=restart_s)


def rollback_for_spike(run: RunFacts, f: FindingFacts, incident: IncidentSpec,
                       rec: RecoveryFacts, cfg: PolicyConfig, now: float) -> Restart | Stop:
    """Roll back to the last good checkpoint, skip the batches the spike was seen on, lower the
    LR for a while in proportion.  Each recurrence widens the skip and lowers the LR further;
    past the budget the run is stopped (never a loop)."""
    what = "NaN/Inf" if f.kind == IncidentKind.NONFINITE else "loss spike"
    start = f.step if f.step is not None else (rec.high_step or 0)
    # A loss that climbed to NaN went wrong where the climb started.
    climb = _int_or_none(f.details.get("start_step"))
    if climb is not None:
        start = min(start, climb)
    detected = _int_or_none(f.details.get("detected_at_step"))
    if detected is None or detected < start:
        detected = f.step if f.step is not None and f.step >= start else start
    done = rec.restarts_by_cause.get(RestartCause.SPIKE, 0)
    may, why = budget_left(RestartCause.SPIKE, run, rec, cfg)
    if not may:
        return Stop(status=RunStatus.FAILED, incident=incident,
                    reason=f"{what} at step {start} after {done} rollback(s): {why}; the run is "
                           "stopped for a human to look at")
    good = [(s, p) for s, p in rec.checkpoints if s <= start - cfg.rollback_margin_steps]
    if not good:
        return Stop(status=RunStatus.FAILED, incident=incident,
                    reason=f"{what} at step {start}: no complete checkpoint at or before step "
                           f"{start - cfg.rollback_margin_steps} to roll back to")
    ck_step, ck_path = good[-1]
    skip, lr = rollback_plan(start, detected, ck_step, rec, cfg, done)
    again = f" (rollback {done + 1}: the spike came back)" if done else ""
    seen = f", detected at step {detected}" if detected != start else ""
    reason = (f"{what} at step {start}{seen}: roll back to step {ck_step}, skip batches "
              f"{skip[0][0]}-{skip[0][1]}, LR x{lr.scale:g} for {lr.steps} steps then back "
              f"over {lr.ramp_steps}{again}")
    return Restart(attempt=run.attempt + 1, checkpoint=ck_path, not_before=now, reason=reason,
                   incident=incident, skip=skip, lr=lr, cause=RestartCause.SPIKE,
                   rollback_to_step=ck_step)


def sdc_message(details: Mapping[str, Any], node: str | None) -> str:
    """What an incident of silent data corruption says: the step of the first disagreement,
    the rank(s) and node named (or the suspects, with two replicas)."""
    step = details.get("first_disagreement", details.get("step"))
    corrupt = [r for r in details.get("corrupt") or [] if isinstance(r, int)]
    n = details.get("replicas")
    if corrupt:
        who = (f"rank {', '.join(map(str, corrupt))}" + (f" on node {node}" if node else "")
               + f" disagrees with the other {int(n) - len(corrupt) if isinstance(n, int) else ''}"
               " replicas")
    else:
        suspects = details.get("suspects") or []
        who = (f"ranks {', '.join(map(str, suspects))} disagree and no majority names the "
               "corrupt one")
    return (f"silent data corruption: the replicas' parameter fingerprints disagree at step "
            f"{step}: {who}")


def rollback_for_sdc(run: RunFacts, f: FindingFacts, incident: IncidentSpec,
                     rec: RecoveryFacts, cfg: PolicyConfig, now: float) -> Restart | Stop:
    """Silent data corruption: roll back to the newest checkpoint at or before the last step
    the replicas agreed at (the state saved after that may carry the corruption), without
    skipping data or lowering the LR (the data is not at fault), and retrain.  The node of
    the corrupt rank is judged by the host ledger (``detect.node_health``: the same node
    again within the window is cordoned and replaced at this restart)."""
    first = _int_or_none(f.details.get("first_disagreement")) or f.step or 0
    agreed = _int_or_none(f.details.get("last_agreed_step"))
    limit = agreed if agreed is not None else first - 1
    may, why = budget_left(RestartCause.SDC, run, rec, cfg)
    if not may:
        return Stop(status=RunStatus.FAILED, incident=incident,
                    reason=f"{incident.cause}; {why}: the run is stopped for a human to look at")
    good = [(s, p) for s, p in rec.checkpoints if s <= limit]
    if not good:
        return Stop(status=RunStatus.FAILED, incident=incident,
                    reason=f"{incident.cause}; no complete checkpoint at or before step {limit}"
                           " (the last the replicas agreed at) to roll back to")
    ck_step, ck_path = good[-1]
    reason = (f"{incident.cause}; roll back to step {ck_step}, the newest checkpoint the "
              f"replicas agreed on ({ck_path})")
    chosen = replace(incident, cause=reason, details={**incident.details, "checkpoint": ck_path,
                                                      "checkpoint_step": ck_step})
    return Restart(attempt=run.attempt + 1, checkpoint=ck_path, not_before=now, reason=reason,
                   incident=chosen, cause=RestartCause.SDC, rollback_to_step=ck_step)


def rollback_plan(start: int, detected: int, ck_step: int, rec: RecoveryFacts,
                  cfg: PolicyConfig, done: int
                  ) -> tuple[tuple[tuple[int, int], ...], LRSchedule]:
    """The skip range and LR schedule of a rollback past a spike that started at step
    ``start`` and was detected at step ``detected``, after ``done`` earlier rollbacks.

    Skip: from ``rollback_skip_before`` batches before the spike's first batch through the
    detection step's batch (+ ``rollback_skip_after``), or ``rollback_skip_batches`` when
    set; the length doubles on each recurrence; never before the checkpoint's own batch.
    LR: x ``rollback_lr_scale ** (done + 1)`` for ``rollback_lr_ratio`` x the batches
    skipped (or ``rollback_lr_steps``), back over half that (or ``rollback_lr_ramp_steps``)."""
    widen = 2 ** done
    spike_batch = rec.batch_index.get(start, start)
    seen_batch = rec.batch_index.get(detected, spike_batch + (detected - start))
    base = spike_batch - cfg.rollback_skip_before
    if cfg.rollback_skip_batches is not None:
        length = cfg.rollback_skip_batches
    else:
        length = max(1, seen_batch + cfg.rollback_skip_after - base + 1)
    first = max(rec.batch_index.get(ck_step, ck_step), base)
    last = max(first, base + length * widen - 1)
    skipped = last - first + 1
    steps = (cfg.rollback_lr_steps if cfg.rollback_lr_steps is not None
             else math.ceil(cfg.rollback_lr_ratio * skipped))
    ramp = cfg.rollback_lr_ramp_steps if cfg.rollback_lr_ramp_steps is not None else steps // 2
    lr = LRSchedule(scale=cfg.rollback_lr_scale ** (done + 1), steps=steps, ramp_steps=ramp)
    return ((first, last),), lr


def operator_rollback(run: RunFacts, *, checkpoint: str, step: int,
                      skip: tuple[tuple[int, int], ...], lr: LRSchedule | None, reason: str,
                      actor: str, now: float) -> Decision:
    """An operator's rollback: to the named checkpoint, at once, outside the budgets."""
    if run.status in FINAL_STATUSES:
        return Note(Verdict.IGNORED, f"run is {run.status}")
    return Restart(attempt=run.attempt + 1, checkpoint=checkpoint, not_before=now,
                   reason=reason or f"operator rollback to step {step}", actor=actor,
                   counts_against_budget=False, skip=skip, lr=lr, cause=RestartCause.OPERATOR,
                   rollback_to_step=step)


# ---------------------------------------------------------------------------------------------
# Attempt mismatch: an agent that runs another attempt than the run's


@dataclass(frozen=True)
class RealignSent:
    """The realign command already sent to the agent during this mismatch."""

    status: CommandStatus
    age_s: float  # since it was created
    detail: str = ""


@dataclass(frozen=True)
class MismatchFacts:
    agent_id: int
    node: str
    agent_attempt: int  # the attempt its newest batch carried
    run_attempt: int
    mismatch_s: float  # how long it has reported an attempt other than the run's
    agent_state: str = ""
    last_seen_s: float = 0.0  # since its newest batch
    restart_in_progress: bool = False  # a gang restart is under way: lagging is expected
    realign: RealignSent | None = None
    incident_open: bool = False  # an attempt-mismatch incident of this agent is open


@dataclass(frozen=True)
class Realign:
    """Tell one agent to relaunch its workers as the run's current attempt (no plan: each
    worker resumes from the newest complete checkpoint of its own directory)."""

    agent_id: int
    attempt: int
    reason: str


MismatchDecision = Note | Realign | OpenIncident


def on_attempt_mismatch(f: MismatchFacts, cfg: PolicyConfig) -> MismatchDecision:
    """Never wait forever on an agent whose reports carry another attempt than the run's:
    realign it within ``realign_after_s``; if that does not work, open an incident that
    says why (the run's detectors see none of that agent's reports meanwhile)."""
    if f.restart_in_progress:
        return Note(Verdict.WAIT, "a restart is under way")
    if f.mismatch_s < cfg.realign_after_s:
        return Note(Verdict.WAIT, f"mismatch for {f.mismatch_s:.1f} s")
    what = (f"agent on node {f.node} reports attempt {f.agent_attempt} while run is at "
            f"attempt {f.run_attempt}")
    if f.realign is None:
        return Realign(agent_id=f.agent_id, attempt=f.run_attempt,
                       reason=f"realign: {what} (for {f.mismatch_s:.0f} s); relaunch as "
                              f"attempt {f.run_attempt}")
    if f.incident_open:
        return Note(Verdict.WAIT, "incident already open")
    r = f.realign
    if r.status != CommandStatus.FAILED and r.age_s < cfg.realign_timeout_s:
        return Note(Verdict.WAIT, f"realign command {r.status} {r.age_s:.0f} s ago")
    if r.status == CommandStatus.FAILED:
        why = f"the agent could not relaunch as attempt {f.run_attempt}: {r.detail}"
    elif r.status == CommandStatus.PENDING:
        why = (f"the agent has not picked up the command to relaunch as attempt "
               f"{f.run_attempt} in {r.age_s:.0f} s (state {f.agent_state or 'unknown'}, last "
               f"seen {f.last_seen_s:.0f} s ago)")
    else:
        why = (f"it was told to relaunch as attempt {f.run_attempt} {r.age_s:.0f} s ago "
               f"({r.status}) and still reports attempt {f.agent_attempt}")
    return OpenIncident(IncidentSpec(
        kind=IncidentKind.ATTEMPT_MISMATCH, attempt=f.run_attempt, agent_id=f.agent_id,
        node=f.node,
        cause=(f"{what}: {why}. Its reports are not those of the run's attempt, so none of "
               "them count (no step, no detection); its local state may belong to another "
               "run of the same name, or it missed a restart"),
        details={"agent_attempt": f.agent_attempt, "run_attempt": f.run_attempt,
                 "realign_status": r.status, "agent_state": f.agent_state}))


# ---------------------------------------------------------------------------------------------
# Checkpoint protection (what the workers' retention must keep)

PROTECT_MAX = 16  # paths per run; the oldest incidents' checkpoints go first past it


@dataclass(frozen=True)
class ProtectFacts:
    # Complete checkpoints of the current lineage: (step, unix time saved, path), oldest first.
    checkpoints: tuple[tuple[int, float, str], ...] = ()
    # Open incidents: (kind, step where it started or None, opened at).
    open_incidents: tuple[tuple[str, int | None, float], ...] = ()
    # Checkpoints named by restart actions not yet resumed (a rollback's target).
    pending_targets: tuple[str, ...] = ()


def protected_checkpoints(facts: ProtectFacts, cfg: PolicyConfig) -> list[str]:
    """The checkpoints retention must keep besides the newest few: for each open incident the
    last good checkpoint before it (for a spike, the one a rollback would pick: ``margin``
    steps before its start; without a step, the newest saved before it opened), and the
    target of every pending restart.  Sorted, at most ``PROTECT_MAX``."""
    out: list[str] = list(dict.fromkeys(facts.pending_targets))
    for kind, step, opened_at in sorted(facts.open_incidents, key=lambda i: -i[2]):
        if step is not None:
            limit = step - (cfg.rollback_margin_steps if kind in ROLLBACK_KINDS else 0)
            good = [p for s, _, p in facts.checkpoints if s <= limit]
        else:
            good = [p for _, t, p in facts.checkpoints if t <= opened_at]
        if good and good[-1] not in out:
            out.append(good[-1])
    return sorted(out[:PROTECT_MAX])


# ---------------------------------------------------------------------------------------------
# Node health: cordons on evidence, probation (the rule: ``detect.node_health``)


@dataclass(frozen=True)
class Cordon:
    """Fence ``node`` off: the membership replaces it at the next restart and never chooses
    it as a member while it is cordoned.  Restarts nothing by itself."""

    node: str
    reason: str
    actor: str = Actor.POLICY
    evidence_ids: tuple[int, ...] = ()
    rule: str = ""  # the setting of the rule that holds (``cordon.<rule>``); "" for an operator
    run_id: int | None = None  # the run whose failure tipped it over
    # In ``run_id`` only: the evidence came from a source not trusted for the host, so the
    # run replaces the node and no other run (nor the shared ledger) is affected.
    in_run_only: bool = False


@dataclass(frozen=True)
class Uncordon:
    """An operator lets a cordoned node back on probation: healthy once it passes a
    preflight, cordoned again by a failed one."""

    node: str
    reason: str
    actor: str


@dataclass(frozen=True)
class PassProbation:
    """A node on probation passed a preflight: healthy again."""

    node: str
    reason: str
    run_id: int | None = None
    evidence_ids: tuple[int, ...] = ()


HostDecision = Note | Cordon | Uncordon | PassProbation


def on_host_evidence(node: str, *, state: str, cleared_at: float | None,
                     evidence: Sequence[node_health.Evidence], now: float,
                     cfg: node_health.CordonConfig, run_id: int | None = None,
                     in_run_only: bool = False) -> Note | Cordon:
    """What new evidence against ``node`` means: a cordon when the rule holds over its
    evidence since its last uncordon (``cleared_at``; the older was judged and cleared).
    ``in_run_only``: the evidence is run ``run_id``'s own, from a source not trusted for the
    host (``state`` is the node's in that run): the cordon holds in that run only."""
    if state == HostState.CORDONED:
        return Note(Verdict.IGNORED, f"node {node} is cordoned already")
    if not cfg.enabled:
        return Note(Verdict.IGNORED, "cordon.enabled is false: only operators cordon")
    counted = [e for e in evidence if cleared_at is None or e.t > cleared_at]
    verdict = node_health.judge(counted, now=now, cfg=cfg)
    if verdict is None:
        return Note(Verdict.WAIT, "no cordon rule holds")
    where = " (in this run only: its agent's token is not trusted for the host)" \
        if in_run_only else ""
    return Cordon(node=node, reason=f"cordon.{verdict.rule}: {verdict.reason}{where}",
                  evidence_ids=verdict.evidence_ids, rule=verdict.rule, run_id=run_id,
                  in_run_only=in_run_only)


def on_preflight_passed(node: str, *, state: str, since: float, ran_at: float,
                        run_id: int | None, evidence_ids: tuple[int, ...] = ()
                        ) -> Note | PassProbation:
    """A passed preflight ends a probation that began before it ran (``since``: when the
    node's state began); anywhere else it changes nothing."""
    if state != HostState.PROBATION:
        return Note(Verdict.IGNORED, f"node {node} is {state}, not on probation")
    if ran_at < since:
        return Note(Verdict.LATE, "the preflight ran before the node went on probation")
    return PassProbation(node=node, run_id=run_id, evidence_ids=evidence_ids,
                         reason="passed a preflight on probation: healthy again")


def operator_cordon(node: str, *, state: str, reason: str, actor: str) -> Note | Cordon:
    """An operator's cordon, of a node in any state but cordoned (one never seen too: a host
    may be fenced off before its agent registers)."""
    if state == HostState.CORDONED:
        return Note(Verdict.IGNORED, f"node {node} is cordoned already")
    return Cordon(node=node, reason=reason, actor=actor)


def operator_uncordon(node: str, *, state: str, reason: str, actor: str) -> Note | Uncordon:
    """An operator's uncordon: a cordoned node goes on probation, never straight to healthy
    (a cordon ends with a passed preflight)."""
    if state != HostState.CORDONED:
        return Note(Verdict.IGNORED, f"node {node} is {state}, not cordoned: nothing to "
                                     "uncordon")
    return Uncordon(node=node, reason=reason, actor=actor)


# -- the fleet (the scheduler that owns the machines) -------------------------------------------


@dataclass(frozen=True)
class FleetPlan:
    """What the scheduler's node states and the ledger call for: ledger changes (a node the
    scheduler drained or lost reads cordoned, with the scheduler's reason; one it put back
    leaves the cordon it caused), and scheduler commands (a node trainwarden cordoned is
    drained there; a drain of trainwarden's whose cordon was lifted is resumed)."""

    ledger: list[Cordon | Uncordon] = field(default_factory=list)
    drain: list[tuple[str, str]] = field(default_factory=list)  # (node, reason)
    resume: list[str] = field(default_factory=list)


def fleet_decisions(ledger: Mapping[str, tuple[str, str, str]],
                    nodes: Mapping[str, FleetNode]) -> FleetPlan:
    """``ledger``: node -> (state, actor, reason) of the nodes with a ledger row; ``nodes``:
    the scheduler's.  Only nodes the scheduler knows are concerned.  An administrator's
    drain (its reason does not start with ``trainwarden:``) is never lifted; a node the
    scheduler says is down or drained is never given a rank (it reads cordoned)."""
    plan = FleetPlan()
    for name, n in sorted(nodes.items()):
        state, actor, reason = ledger.get(name, (HostState.HEALTHY, "", ""))
        cordoned = state == HostState.CORDONED
        if n.state != FleetNodeState.AVAILABLE and not n.ours:
            if not cordoned:
                why = f"{n.state} in Slurm ({n.raw_state})" + (f": {n.reason}" if n.reason
                                                                  else "")
                plan.ledger.append(Cordon(name, f"slurm: {why}", actor=Actor.FLEET))
        elif n.state == FleetNodeState.DRAINED and n.ours:
            if not cordoned:
                plan.resume.append(name)
        elif n.state == FleetNodeState.AVAILABLE and cordoned:
            if actor == Actor.FLEET:
                plan.ledger.append(Uncordon(name, f"slurm: {name} is back in service "
                                                  f"({n.raw_state})", actor=Actor.FLEET))
            else:
                plan.drain.append((name, f"{REASON_PREFIX} {reason}"))
    return plan


@dataclass(frozen=True)
class Requeue:
    """Put the run's scheduler job back in the queue (``fleet.requeue``): the nodes its
    attempt waits for are drained first (``drain``: node, reason), so the next allocation
    avoids them.  The job's agents register again to the same run, which goes on as a new
    attempt from the newest checkpoint (the loss was counted when it happened)."""

    job: str
    attempt: int  # the attempt that waits (a job is requeued once for it)
    drain: tuple[tuple[str, str], ...]
    reason: str


def requeue_when_no_spare(*, enabled: bool, attempt: int, waiting: Mapping[str, str],
                          job: str, requeued_for: int | None) -> Requeue | Note:
    """A run whose attempt stands by for a node (a member lost or cordoned, no spare free,
    the run may not shrink: ``waiting``, node -> why) is requeued in its scheduler without
    those nodes, when ``fleet.requeue`` is on and its agents named their job (``job``; ""
    when they run outside one).  Once per waiting attempt (``requeued_for``: the attempt the
    run's last requeue was for)."""
    if not waiting:
        return Note(Verdict.IGNORED, "the run waits for no node")
    if not enabled:
        return Note(Verdict.WAIT, "fleet.requeue is off: the run stands by for a node")
    if not job:
        return Note(Verdict.WAIT, "the run's agents named no scheduler job to requeue: the run "
                                  "stands by for a node")
    if requeued_for == attempt:
        return Note(Verdict.ONGOING, f"job {job} was requeued for attempt {attempt}: waiting "
                                     "for its new allocation")
    nodes = ", ".join(f"{n} ({why})" for n, why in sorted(waiting.items()))
    reason = (f"no spare is free and the run may not shrink: job {job} is requeued without "
              f"{nodes}")
    return Requeue(job=job, attempt=attempt,
                   drain=tuple((n, f"{REASON_PREFIX} {why}; the run's job {job} is requeued "
                                   "without it") for n, why in sorted(waiting.items())),
                   reason=reason)

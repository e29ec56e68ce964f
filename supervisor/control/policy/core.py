"""Facts the policy decides from, its settings, and the restart budgets: what every
decision of the package reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainwarden.agent.core import rootcause
from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.agent.core.findings import Severity
from trainwarden.agent.core.rootcause import FailureClass
from trainwarden.supervisor.enums import (
    INTERRUPTING,
    ROLLED_BACK,
    WATCHED,
    Actor,
    IncidentKind,
    RestartCause,
)


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


def _int_or_none(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


# Failures that end the attempt: the gang restarts.  One attempt fails once: whichever of
# these is seen first for an attempt decides, the others of the same attempt are echoes.
RESTART_KINDS = INTERRUPTING
# Incidents that stay open while the condition lasts, without a restart.
WATCH_KINDS = WATCHED
# Incidents answered by a rollback (when rollbacks are enabled).
ROLLBACK_KINDS = ROLLED_BACK


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

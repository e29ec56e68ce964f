"""A worker group's exit: a crash (its cause, the rules that stop a run), a hang the agent's
watchdog ended, a completion.

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
* The run completes when every agent of the run reported "completed" for the current attempt."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from trainwarden.agent.core import rootcause
from trainwarden.agent.core.rootcause import FailureClass
from trainwarden.agent.core.states import ExitOutcome
from trainwarden.supervisor.control.policy.core import (
    CAUSE_OF_KIND,
    STOP_IDENTICAL_FAILURE,
    STOP_REPEATED_USER_ERROR,
    CrashCause,
    ExitFacts,
    PolicyConfig,
    RecoveryFacts,
    RunFacts,
    _int_or_none,
    backoff_s,
    budget_left,
)
from trainwarden.supervisor.control.policy.decisions import (
    Complete,
    Decision,
    IncidentSpec,
    Note,
    Restart,
    Stop,
)
from trainwarden.supervisor.control.policy.membership import (
    RendezvousFacts,
    network_partition,
    node_death,
)
from trainwarden.supervisor.detect import node_health
from trainwarden.supervisor.enums import FINAL_STATUSES, IncidentKind, RunStatus, Verdict


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
    may_wait_for_member: bool = False,
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
    while its host is heard is cut off by a network partition (``network_partition``).
    ``may_wait_for_member``: the host's own failure (a member did not join) is young enough
    to be held for that member's report.  It is held longer than a lost peer's confirmation:
    the member's torchrun gives up on the same rendezvous timeout counted from its own start,
    which on a busy machine comes many seconds after the host's."""
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
                                  silent=silent_peers or {}, may_wait=may_wait_for_member,
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

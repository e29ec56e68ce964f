"""Node health: cordons on evidence, probation (the rule: ``detect.node_health``), and the
fleet (the scheduler that owns the machines)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from trainwarden.supervisor.control.policy.decisions import Note
from trainwarden.supervisor.detect import node_health
from trainwarden.supervisor.enums import Actor, HostState, Verdict
from trainwarden.supervisor.fleet import (
    REASON_PREFIX,
    FleetJob,
    FleetNode,
    FleetNodeState,
    run_comment,
)


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
class RequeueWanted:
    """The run's attempt stands by for nodes (``waiting``: node, why) and its agents named
    their scheduler job: requeue it, once the scheduler confirms the job is the run's
    (``requeue_checked``)."""

    job: str  # the job the run's agents named: their claim
    attempt: int  # the attempt that waits (a job is requeued once for it)
    waiting: tuple[tuple[str, str], ...]
    reason: str


@dataclass(frozen=True)
class Requeue:
    """Put the run's scheduler job back in the queue (``fleet.requeue``), its next allocation
    off the nodes its attempt waits for (``exclude``, for this job).  ``cordons``: the waiting
    nodes, cordoned in the shared ledger when their agent was trusted for the host, in this
    run only otherwise; ``drain``: the trusted ones (node, reason), drained in the scheduler
    first (for every job).  The job's agents register again to the same run, which goes on as
    a new attempt from the newest checkpoint (the loss was counted when it happened)."""

    job: str
    attempt: int
    drain: tuple[tuple[str, str], ...]
    reason: str
    exclude: tuple[str, ...] = ()
    cordons: tuple[Cordon, ...] = ()


def requeue_when_no_spare(*, enabled: bool, attempt: int, waiting: Mapping[str, str],
                          job: str, requeued_for: int | None) -> RequeueWanted | Note:
    """A run whose attempt stands by for a node (a member lost or cordoned, no spare free,
    the run may not shrink: ``waiting``, node -> why) is requeued in its scheduler without
    those nodes, when ``fleet.requeue`` is on and its agents named their job (``job``; ""
    when they run outside one).  Once per waiting attempt (``requeued_for``: the attempt the
    run's last requeue was for).  What the agents named is checked against the scheduler
    before anything is done (``requeue_checked``)."""
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
    return RequeueWanted(job=job, attempt=attempt, waiting=tuple(sorted(waiting.items())),
                         reason=reason)


def requeue_checked(want: RequeueWanted, *, run_id: int, run: str, scheduled: FleetJob | None,
                    said: str, members: Set[str], trusted: Mapping[str, bool],
                    named_by: Sequence[str] = ()) -> Requeue | Note:
    """The requeue ``want`` asks for, against the scheduler's word about the job
    (``scheduled``; None: it has no such job or could not say, ``said``: its answer).  The
    job is the agents' claim: it is requeued only when the scheduler runs it on every node
    of the run ``run`` (its name; ``members``, the waiting nodes among them), no other
    active run's agents named it too (``named_by``: those runs), and the job's comment,
    which only its owner may set, names exactly this run (``run_comment``).  ``trusted``:
    node -> whether the run's agent on it is trusted for the host (a token scoped to no
    run): only such a node is cordoned in the shared ledger and drained in the scheduler;
    any other is cordoned in this run only.  Every waiting node is excluded from the job's
    next allocation."""
    job = want.job
    if scheduled is None:
        return Note(Verdict.WAIT, f"job {job} is not requeued: the scheduler has no such job "
                                  f"or could not say ({said})")
    if named_by:
        return Note(Verdict.WAIT, f"job {job} is not requeued: the agents of "
                                  f"{', '.join(sorted(named_by))} named it too: whose job it "
                                  "is cannot be told")
    if not scheduled.running:
        return Note(Verdict.WAIT, f"job {job} is not requeued: the scheduler has it "
                                  f"{scheduled.state}, not running")
    waiting = dict(want.waiting)
    missing = sorted((set(members) | set(waiting)) - scheduled.nodes)
    if missing:
        held = ", ".join(sorted(scheduled.nodes)) or "no node"
        return Note(Verdict.WAIT, f"job {job} is not requeued: its allocation ({held}) does "
                                  f"not hold the run's {', '.join(missing)}: it is not the "
                                  "run's job")
    if scheduled.comment != run_comment(run):
        has = repr(scheduled.comment) if scheduled.comment else "none"
        return Note(Verdict.WAIT, f"job {job} is not requeued: its comment ({has}) does not "
                                  f"name run {run}: set it with `scontrol update JobId={job} "
                                  f"Comment={shlex.quote(run_comment(run))}` in the job "
                                  "(deploy/slurm/train.sbatch does) or `sbatch --comment`")
    drain, cordons = [], []
    for n, why in want.waiting:
        said_of = f"{why}; the run's job {job} is requeued without it"
        if trusted.get(n, False):
            drain.append((n, f"{REASON_PREFIX} {said_of}"))
            cordons.append(Cordon(n, f"{REASON_PREFIX} {said_of}", run_id=run_id))
        else:
            cordons.append(Cordon(n, f"{REASON_PREFIX} {said_of} (in this run only: its "
                                     "agent's token is not trusted for the host)",
                                  run_id=run_id, in_run_only=True))
    return Requeue(job=job, attempt=want.attempt, drain=tuple(drain), reason=want.reason,
                   exclude=tuple(n for n, _ in want.waiting), cordons=tuple(cordons))

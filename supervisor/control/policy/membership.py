"""Membership decisions: a node's death confirmed by its peers, a network partition, a
run that grows back or shrinks (shrink or wait), a member cordoned before its attempt trained."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from trainwarden.agent.protocol import ResumePlan
from trainwarden.supervisor.control.policy.core import (
    CAUSE_OF_KIND,
    CrashCause,
    ExitFacts,
    PolicyConfig,
    RecoveryFacts,
    RunFacts,
    backoff_s,
    budget_left,
)
from trainwarden.supervisor.control.policy.decisions import (
    Decision,
    IncidentSpec,
    Note,
    Restart,
    Stop,
)
from trainwarden.supervisor.detect import node_health, partition
from trainwarden.supervisor.enums import IncidentKind, RestartCause, RunStatus, Verdict
from trainwarden.supervisor.goodput import elastic


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


def on_corrupting_member(run: RunFacts, *, cordoned: Mapping[str, str], pending: ResumePlan,
                         sdc_rollback: bool = True) -> Stop:
    """A member of a restart that has not resumed yet was cordoned for silent data
    corruption (the corruption that caused the restart was the second on that node within
    the window) and no free spare takes its node rank: the run is stopped, failed, rather than
    rolled back again onto a machine known to corrupt its state (where a third rollback would
    end as the second did).  The reason names the cordon and the checkpoint to resume from on
    healthy nodes.  ``sdc_rollback``: the pending restart is that corruption's rollback (its
    checkpoint is the newest the replicas agreed on); else another restart (a crash's, the
    cordon another run's evidence on a shared host) whose checkpoint is named as such."""
    said = "; ".join(f"{node} is cordoned for silent data corruption ({why})"
                     for node, why in sorted(cordoned.items()))
    if not sdc_rollback:
        where = (f"resume from {pending.checkpoint}, the pending restart's checkpoint"
                 if pending.checkpoint else "the pending restart named no checkpoint")
    elif pending.checkpoint:
        where = f"resume from {pending.checkpoint}, the newest checkpoint the replicas agreed on"
    else:
        where = "no checkpoint the replicas agreed on to resume from"
    return Stop(status=RunStatus.FAILED,
                reason=f"{said}, and no free spare can take its node rank: the run is stopped "
                       "rather than rolled back onto a machine that corrupts its state again; "
                       f"{where}, on healthy nodes")

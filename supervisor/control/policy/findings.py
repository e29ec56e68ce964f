"""Findings of the detectors (and the run's agents gone silent or back): an event, an
incident, a restart or a rollback."""

from __future__ import annotations

import math
from dataclasses import replace

from trainwarden.agent.core.findings import Severity
from trainwarden.supervisor.control.policy.core import (
    CAUSE_OF_KIND,
    RESTART_KINDS,
    ROLLBACK_KINDS,
    FindingFacts,
    PolicyConfig,
    RecoveryFacts,
    RunFacts,
    backoff_s,
    budget_left,
)
from trainwarden.supervisor.control.policy.decisions import (
    FindingDecision,
    IncidentSpec,
    Note,
    OpenIncident,
    RecordEvent,
    Restart,
    Stop,
)
from trainwarden.supervisor.control.policy.rollback import (
    rollback_for_sdc,
    rollback_for_spike,
    spike_cost_of,
)
from trainwarden.supervisor.enums import (
    FINAL_STATUSES,
    IncidentKind,
    PresenceEvent,
    RunStatus,
    Verdict,
)


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

"""Attempt mismatch: an agent that runs another attempt than the run's."""

from __future__ import annotations

from dataclasses import dataclass

from trainwarden.agent.core.states import CommandStatus
from trainwarden.supervisor.control.policy.core import PolicyConfig
from trainwarden.supervisor.control.policy.decisions import IncidentSpec, Note, OpenIncident
from trainwarden.supervisor.enums import IncidentKind, Verdict


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

"""The decisions the policy returns: typed, one class per kind of act."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from trainwarden.agent.protocol import LRSchedule, ResumePlan
from trainwarden.supervisor.enums import Actor, RestartCause, Verdict


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

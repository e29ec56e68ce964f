"""The fleet: the scheduler that owns the machines (Slurm), as the health ledger sees it.

A backend answers three things, each a command of the scheduler's run with a deadline:

* ``node_states``: every node the scheduler knows, with its state (``FleetNodeState``) and
  the scheduler's reason, and whether a drain is trainwarden's (its reason starts with
  ``REASON_PREFIX``);
* ``cordon``: fence the node off in the scheduler (Slurm: drain it), with a reason that starts
  with ``REASON_PREFIX``;
* ``uncordon``: put the node back in service, only where the fence is trainwarden's;
* ``job``: what the scheduler says of a job its agents named (its state, the nodes of its
  allocation, and its comment, which its owner sets to ``run_comment(run)`` to bind it to the
  run): the agents' word for which job they run in is a claim, checked against it;
* ``requeue``: end the job's current allocation and put the job back in the scheduler's queue,
  so it runs again, as the same job, on nodes the scheduler chooses: never a fenced one, nor
  one excluded for that job.

Every command's outcome is a ``FleetResult`` (the command line, its exit code and output),
which the supervisor audits.  What to do with the states is the policy's
(``control.policy.fleet_decisions``); running the commands and recording them is
``control.fleet_sync``'s.  A Kubernetes backend fits the same protocol (cordon:
``spec.unschedulable`` plus a ``trainwarden.io/cordoned`` taint and a node condition;
requeue: the Job's or JobSet's restart, its pods recreated off the cordoned nodes); it is
not implemented.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

REASON_PREFIX = "trainwarden:"
# How the cordon the fleet sets for a node its scheduler says is down begins (the node-lost
# detector reads it as the scheduler's word that the node is lost).
DOWN_REASON_PREFIX = "slurm: down"
# How a scheduler job's comment names the run it belongs to (deploy/slurm/train.sbatch sets it):
# the job's owner alone may set it, so a job is requeued for a run only when it names that run.
RUN_COMMENT_PREFIX = "trainwarden-run="


def run_comment(run: str) -> str:
    """The comment that binds a scheduler job to the run ``run`` (its name)."""
    return f"{RUN_COMMENT_PREFIX}{run}"


class FleetNodeState(StrEnum):
    """A node as the scheduler has it, reduced to what the membership needs."""

    AVAILABLE = "available"  # idle, allocated, mixed: it may run a job
    DRAINED = "drained"  # drained or draining: fenced off by someone
    DOWN = "down"  # down, failed, not responding: the scheduler says it is lost


@dataclass(frozen=True)
class FleetNode:
    name: str
    state: FleetNodeState
    reason: str = ""  # the scheduler's reason (who drained it and why), "" without one
    raw_state: str = ""  # the scheduler's own words (Slurm: IDLE+DRAIN)

    @property
    def ours(self) -> bool:
        """A fence trainwarden set (its reason starts with ``REASON_PREFIX``)."""
        return self.reason.startswith(REASON_PREFIX)


@dataclass(frozen=True)
class FleetJob:
    """A scheduler job as the scheduler has it."""

    job: str
    state: str  # the scheduler's own words (Slurm: RUNNING, PENDING, COMPLETING...)
    running: bool  # its allocation runs now (the only state a requeue applies to)
    nodes: frozenset[str]  # the nodes of its allocation, by name (none while pending)
    excluded: str = ""  # the nodes it already may not use (Slurm: ExcNodeList), "" for none
    comment: str = ""  # the comment its owner set (Slurm: Comment), "" for none


@dataclass(frozen=True)
class FleetResult:
    command: str  # the command line, as run
    ok: bool
    output: str  # its output (stdout and stderr), or why it could not run

    def describe(self) -> str:
        out = self.output.strip()[:1000]
        return f"`{self.command}` {'succeeded' if self.ok else 'FAILED'}" + \
            (f": {out}" if out else "")


class Fleet(Protocol):
    """A scheduler backend (``fleet.slurm.SlurmFleet``)."""

    name: str

    def check(self) -> FleetResult:
        """Whether the supervisor can fence nodes off here (at start)."""
        ...

    def node_states(self) -> tuple[dict[str, FleetNode], FleetResult]:
        """Every node the scheduler knows, by name (empty when the command failed)."""
        ...

    def cordon(self, node: str, reason: str) -> FleetResult:
        ...

    def uncordon(self, node: str) -> FleetResult:
        ...

    def job(self, job: str) -> tuple[FleetJob | None, FleetResult]:
        """What the scheduler says of ``job`` (None: no such job, or the command failed)."""
        ...

    def requeue(self, job: FleetJob, exclude: Sequence[str]) -> list[FleetResult]:
        """Put ``job`` back in the queue: its processes end, and it runs again as the same
        job on a new allocation that holds none of ``exclude`` (for this job only).  The
        commands run, in order; the first is the requeue itself (the job was requeued when it
        succeeded), and a failed one stops the rest, except that a job held for the exclusion
        is always released."""
        ...

"""Each attempt's members, decided (pure): which node holds each node rank of the run's world.

A gang restart keeps the world size, so the run ends as a clean run would (same ranks, same
data order).  A member that is lost (silent past the node-lost deadline) or cordoned gives its
node rank to a free spare, and the membership epoch grows; without a free spare the rank
waits (every member stands by, nothing restarts in a loop) until a spare registers or the
lost node comes back.  The policy (``trainwarden.supervisor.control.policy``) applies this
to every restart it decides; ``trainwarden.supervisor.store.membership`` records the result.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class MembershipFacts:
    nnodes: int | None  # the declared world; None: not a torchrun launch (nothing to decide)
    epoch: int
    members: Mapping[int, str]  # node rank -> node
    live: frozenset[str]  # nodes heard from within the node-lost deadline
    spares: Sequence[str]  # free spares, in the order they are preferred
    cordoned: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Replacement:
    node_rank: int
    old: str | None  # None: the rank had no node
    new: str
    why: str  # "lost", "cordoned", "vacant"


@dataclass(frozen=True)
class MemberPlan:
    epoch: int
    nnodes: int | None
    members: dict[int, str]  # node rank -> node (a waiting rank keeps its missing node)
    replaced: tuple[Replacement, ...] = ()
    waiting: tuple[int, ...] = ()  # node ranks with no node fit to run and no free spare
    missing: dict[int, str] = field(default_factory=dict)  # waiting rank -> why
    # node rank -> its cordoned node, kept for want of a free spare (running on a suspect
    # node costs less than not running at all; it is replaced as soon as a spare is free)
    kept_cordoned: dict[int, str] = field(default_factory=dict)

    def summary(self) -> str:
        """One line for a restart's reason ("" when nothing changed)."""
        parts = [f"{r.new} takes node rank {r.node_rank}"
                 + (f" of {r.old} ({r.why})" if r.old else " (vacant)") for r in self.replaced]
        parts += [f"node rank {k} waits for a node ({self.missing[k]}; no spare left)"
                  for k in self.waiting]
        parts += [f"node rank {k} stays on {node} (cordoned; no spare left)"
                  for k, node in sorted(self.kept_cordoned.items())]
        return "; ".join(parts)

    def wire(self, endpoint: str | None) -> dict[str, object]:
        """The membership a restart command carries (``ResumePlan.membership``)."""
        return {"epoch": self.epoch, "nnodes": self.nnodes,
                "endpoint": endpoint,
                "members": {node: rank for rank, node in sorted(self.members.items())},
                "waiting": list(self.waiting)}


def plan_members(f: MembershipFacts) -> MemberPlan:
    """Keep every member fit to run; give the rank of one that is not (lost, cordoned) to the
    next free spare.  Without a free spare a cordoned member keeps its rank (it still runs),
    and a lost one's rank waits (its node stays recorded, so it takes its rank back if it
    returns)."""
    if f.nnodes is None:
        return MemberPlan(epoch=f.epoch, nnodes=None, members=dict(f.members))
    free = [s for s in f.spares if s in f.live and s not in f.cordoned]
    members: dict[int, str] = {}
    replaced: list[Replacement] = []
    missing: dict[int, str] = {}
    kept: dict[int, str] = {}
    for rank in range(f.nnodes):
        node = f.members.get(rank)
        why = ("vacant" if node is None else "lost" if node not in f.live
               else "cordoned" if node in f.cordoned else None)
        if why is None and node is not None:
            members[rank] = node
        elif free:
            new = free.pop(0)
            members[rank] = new
            replaced.append(Replacement(node_rank=rank, old=node, new=new, why=why or "vacant"))
        elif node is not None and why == "cordoned":
            members[rank] = kept[rank] = node
        else:
            if node is not None:
                members[rank] = node
            missing[rank] = f"{node} {why}" if node is not None else "vacant"
    return MemberPlan(epoch=f.epoch + 1 if replaced else f.epoch, nnodes=f.nnodes,
                      members=members,
                      replaced=tuple(replaced), waiting=tuple(sorted(missing)), missing=missing,
                      kept_cordoned=kept)


@dataclass(frozen=True)
class Capacity:
    """A run's nodes as the API, the dashboard and ``/metrics`` show them (and the alerts
    compare): one computation for all of them."""

    nnodes: int | None  # the declared world
    epoch: int
    spares: int  # free spares: live and not cordoned
    spares_configured: bool  # a node registered into the run as a spare
    missing: tuple[int, ...]  # node ranks with no node fit to run and no spare to take them


def capacity(f: MembershipFacts, *, spares_configured: bool) -> Capacity:
    free = [s for s in f.spares if s in f.live and s not in f.cordoned]
    plan = plan_members(f)
    return Capacity(nnodes=f.nnodes, epoch=f.epoch, spares=len(free),
                    spares_configured=spares_configured, missing=plan.waiting)

"""Each attempt's members, decided (pure): which node holds each node rank of the run's world.

A gang restart keeps the world size, so the run ends as a clean run would (same ranks, same
data order).  A member that is lost (silent past the node-lost deadline) or cordoned gives its
node rank to a free spare, and the membership epoch grows; without a free spare the rank
waits (every member stands by, nothing restarts in a loop) until a spare registers or the
lost node comes back.

A run that accepts a smaller world (``min_nodes`` below the declared one) shrinks instead of
waiting, when the policy chooses to: the members fit to run take node ranks 0..k-1 in their
old order, and the nodes left out become spares.  A shrunk run grows back to the declared
world when asked to (``grow``: the policy asks at a checkpoint), free spares taking the node
ranks above the current world.

The policy (``trainwarden.supervisor.control.policy``) applies this to every restart it
decides; ``trainwarden.supervisor.store.membership`` records the result.
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
    # The nodes the current attempt runs on (None: the declared world); smaller after a
    # shrink.
    world: int | None = None
    # The smallest world the run accepts (None: the declared one, i.e. it never shrinks).
    min_nodes: int | None = None
    # A node registered into the run as a spare (a waiting rank's reason says "no spare
    # left", else "no spare configured").
    spares_configured: bool = True
    # Members a network partition cut off from the rendezvous host: alive, but their ranks go
    # to spares (or wait) like a lost member's.
    cut_off: frozenset[str] = frozenset()
    # Cordoned members cordoned for silent data corruption (``cordon.sdc``): never kept for
    # want of a spare (a machine that corrupts the state again would only be rolled back
    # again); their ranks wait for a node.
    corrupting: frozenset[str] = frozenset()

    @property
    def current(self) -> int | None:
        """The nodes of the current attempt's world."""
        return self.world if self.world is not None else self.nnodes


@dataclass(frozen=True)
class Replacement:
    node_rank: int
    old: str | None  # None: the rank had no node
    new: str
    why: str  # "lost", "cordoned", CORRUPTING, "vacant"


@dataclass(frozen=True)
class Dropped:
    """A node a shrink left out (it becomes a spare)."""

    node_rank: int  # its node rank before the shrink
    node: str
    why: str  # "lost", "cordoned"


@dataclass(frozen=True)
class MemberPlan:
    epoch: int
    nnodes: int | None  # the attempt's world (smaller than ``declared`` after a shrink)
    members: dict[int, str]  # node rank -> node (a waiting rank keeps its missing node)
    replaced: tuple[Replacement, ...] = ()
    waiting: tuple[int, ...] = ()  # node ranks with no node fit to run and no free spare
    missing: dict[int, str] = field(default_factory=dict)  # waiting rank -> why
    # node rank -> its cordoned node, kept for want of a free spare (running on a suspect
    # node costs less than not running at all; it is replaced as soon as a spare is free)
    kept_cordoned: dict[int, str] = field(default_factory=dict)
    declared: int | None = None  # the declared world (None: as ``nnodes``)
    world_before: int | None = None  # the world of the attempt before this plan
    dropped: tuple[Dropped, ...] = ()  # nodes a shrink left out
    # The rendezvous moved to a new port with the same members (the last attempt's was taken).
    moved: bool = False
    # Vacant node ranks waiting beyond those listed in ``waiting`` (a declared world far
    # larger than the nodes that registered is counted, never enumerated).
    unlisted: int = 0
    spares_configured: bool = True  # (``MembershipFacts``'s: how a waiting rank is told)

    @property
    def waiting_count(self) -> int:
        return len(self.waiting) + self.unlisted

    @property
    def full(self) -> int | None:
        """The declared world."""
        return self.declared if self.declared is not None else self.nnodes

    @property
    def resized(self) -> bool:
        """The attempt's world differs from the one before it (a shrink or a grow)."""
        return (self.world_before is not None and self.nnodes is not None
                and self.nnodes != self.world_before)

    def summary(self) -> str:
        """One line for a restart's reason ("" when nothing changed)."""
        parts = []
        if self.resized:
            parts.append(f"the world {'shrinks' if self.dropped else 'grows back'} from "
                         f"{self.world_before} to {self.nnodes} of {self.full} nodes")
        parts += [f"{d.node} (node rank {d.node_rank}, {d.why}) is left out" for d in self.dropped]
        parts += [f"{r.new} takes node rank {r.node_rank}"
                  + (f" of {r.old} ({r.why})" if r.old else f" ({r.why})")
                  for r in self.replaced]
        spares = "no spare left" if self.spares_configured else "no spare configured"
        parts += [f"node rank {k} waits for a node ({self.missing[k]}; {spares})"
                  for k in self.waiting]
        if self.unlisted:
            parts.append(f"{self.unlisted} more vacant node rank(s) wait for a node")
        parts += [f"node rank {k} stays on {node} (cordoned; {spares})"
                  for k, node in sorted(self.kept_cordoned.items())]
        if self.moved:
            parts.append(f"the rendezvous moves to a new port (membership epoch {self.epoch}): "
                         "the last one was taken")
        return "; ".join(parts)

    def wire(self, endpoint: str | None) -> dict[str, object]:
        """The membership a restart command carries (``ResumePlan.membership``)."""
        return {"epoch": self.epoch, "nnodes": self.nnodes, "declared": self.full,
                "endpoint": endpoint,
                "members": {node: rank for rank, node in sorted(self.members.items())},
                "waiting": list(self.waiting)}


# Why a member cordoned for silent data corruption gives its rank up.
CORRUPTING = "cordoned for silent data corruption"


def plan_members(f: MembershipFacts, *, shrink: bool = False, grow: bool = False,
                 move_endpoint: bool = False) -> MemberPlan:
    """Keep every member fit to run; give the rank of one that is not (lost, cordoned) to the
    next free spare.  Without a free spare a cordoned member keeps its rank (it still runs),
    unless it was cordoned for silent data corruption (``corrupting``), and a lost one's rank,
    or a corrupting one's, waits (its node stays recorded, so it takes its rank back if it
    returns).

    ``shrink`` (the policy's choice, for a run with ``min_nodes``): rather than wait, or keep
    a cordoned member, the members fit to run go on as a smaller world of at least
    ``min_nodes``.  ``grow``: a shrunk run takes free spares for the node ranks above its
    world, up to the declared one.  ``move_endpoint``: the epoch grows even when the members
    stay (the rendezvous port moves with it; a world of one node has none to move)."""
    if f.nnodes is None:
        return MemberPlan(epoch=f.epoch, nnodes=None, members=dict(f.members))
    world = f.current or f.nnodes
    free = [s for s in f.spares if s in f.live and s not in f.cordoned]
    members: dict[int, str] = {}
    replaced: list[Replacement] = []
    missing: dict[int, str] = {}
    kept: dict[int, str] = {}
    ranks, unlisted = _ranks(f.members, world, vacant=len(free) + VACANT_LISTED)
    for rank in ranks:
        node = f.members.get(rank)
        why = ("vacant" if node is None else "cut off" if node in f.cut_off
               else "lost" if node not in f.live
               else CORRUPTING if node in f.cordoned and node in f.corrupting
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
    if shrink and (missing or kept):
        fit = [(rank, node) for rank, node in sorted(members.items())
               if rank not in missing and rank not in kept]
        if fit and len(fit) >= (f.min_nodes or f.nnodes):
            dropped = [Dropped(rank, members[rank], "cordoned" if rank in kept else
                               missing[rank].split(" ", 1)[-1])
                       for rank in sorted({*missing, *kept}) if rank in members]
            return MemberPlan(epoch=f.epoch + 1, nnodes=len(fit),
                              members={k: node for k, (_, node) in enumerate(fit)},
                              replaced=tuple(replaced), dropped=tuple(dropped),
                              declared=f.nnodes, world_before=world)
    if grow and world < f.nnodes and not missing:
        for rank in range(world, f.nnodes):
            if not free:
                break
            members[rank] = free.pop(0)
            replaced.append(Replacement(node_rank=rank, old=None, new=members[rank],
                                        why="grow"))
    nnodes = len(members) if world < f.nnodes else f.nnodes
    moved = move_endpoint and not replaced and nnodes > 1
    return MemberPlan(epoch=f.epoch + 1 if replaced or moved else f.epoch, nnodes=nnodes,
                      members=members, moved=moved,
                      replaced=tuple(replaced), waiting=tuple(sorted(missing)), missing=missing,
                      kept_cordoned=kept, declared=f.nnodes, world_before=world,
                      unlisted=unlisted, spares_configured=f.spares_configured)


VACANT_LISTED = 64  # vacant node ranks listed by number (the rest are counted)


def _ranks(members: Mapping[int, str], world: int, *, vacant: int) -> tuple[list[int], int]:
    """The node ranks below ``world`` a plan looks at: every member's, and the ``vacant``
    lowest ranks with no member; and how many vacant ranks are left beyond them.  Work grows
    with the members, never with the declared world."""
    held = sorted(k for k in members if 0 <= k < world)
    out: list[int] = []
    k, i = 0, 0
    listed = 0
    while k < world and listed < vacant:
        if i < len(held) and held[i] == k:
            i += 1
        else:
            out.append(k)
            listed += 1
        k += 1
    ranks = sorted({*held, *out})
    return ranks, world - len(held) - listed


def can_shrink(f: MembershipFacts) -> bool:
    """Whether the run accepts a world smaller than the one it runs (``min_nodes`` below
    it)."""
    return (f.nnodes is not None and f.min_nodes is not None
            and f.min_nodes < (f.current or f.nnodes))


@dataclass(frozen=True)
class Capacity:
    """A run's nodes as the API, the dashboard and ``/metrics`` show them (and the alerts
    compare): one computation for all of them."""

    nnodes: int | None  # the declared world
    epoch: int
    spares: int  # free spares: live and not cordoned
    spares_configured: bool  # a node registered into the run as a spare
    missing: tuple[int, ...]  # node ranks with no node fit to run and no spare to take them
    # (the first ``VACANT_LISTED`` vacant ones listed)
    world: int | None = None  # the nodes the current attempt runs on (a shrink: fewer)
    min_nodes: int | None = None  # the smallest world the run accepts (None: the declared)
    missing_count: int = 0  # node ranks waiting for a node, listed or not

    @property
    def waiting(self) -> int:
        return max(self.missing_count, len(self.missing))


def capacity(f: MembershipFacts, *, spares_configured: bool, ended: bool = False) -> Capacity:
    """``ended``: the run has ended (completed, failed, stopped): its nodes left, and no
    rank of it waits for a node."""
    free = [s for s in f.spares if s in f.live and s not in f.cordoned]
    plan = None if ended else plan_members(f)
    return Capacity(nnodes=f.nnodes, epoch=f.epoch, spares=len(free),
                    spares_configured=spares_configured,
                    missing=plan.waiting if plan is not None else (),
                    world=f.current, min_nodes=f.min_nodes,
                    missing_count=plan.waiting_count if plan is not None else 0)

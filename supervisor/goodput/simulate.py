"""A long run under a failure schedule, simulated as the event stream the supervisor would
store, and accounted by the same ``EttrAccumulator`` the live runs use.

The run trains back-to-back steps of ``step_s``, saves a checkpoint every ``interval_s``
(training stalls ``stall_s`` per save), and meets faults as a Poisson process of mean
``mtbf_s`` while it trains (the clock of the next fault starts when training resumes).  Each
fault is of one ``FaultKind`` (drawn by ``share``): detected ``detect_s`` after it hits, the
new attempt's first step beginning ``restart_s`` after the detection.  A crash or a hang
rolls back to the newest complete checkpoint; a loss spike keeps training until it is
detected (those steps are thrown away: their time is the detection's) and rolls back to the
newest checkpoint saved before it began (the step in flight at the detection still ends, and
is lost).  A fault during a save loses that save.  With ``write_s`` the save is asynchronous:
training stalls ``stall_s`` (the staging), the checkpoint is written in the background and
complete ``write_s`` later (a fault before then loses it, the restore takes the one before),
and a save that falls due while the previous one is still being written waits for it (the
wait is stall too).

A fault of a kind that ``needs_node`` (a node died for good: ``with_node_losses``) restarts
the gang at the same world size only once a node takes the dead one's rank.  A free spare
(``spares`` of them at the start) takes it at once, and the dead node goes to repair and
rejoins the spares ``repair_s`` later.  With no spare free the run waits for whichever comes
first: a node from outside the pool, ``replace_s`` after the detection (it takes the dead
node's place for good and the dead node leaves, so the pool keeps its size), or a repaired
node rejoining (the dead one then goes to repair in its turn).  The wait is part of the
restart (from the decision to the first step); the fault clock runs while training only, so
no fault comes while the run waits.  With the defaults (no spares, ``replace_s`` 0) a node is
at hand at once and such a fault costs what any other does.

Shrinking (``min_nodes`` below the full world of ``nodes``; unset: never): a node loss that
finds no spare free restarts the gang at once, ``restart_s`` after the detection, on the
nodes left, if they are at least ``min_nodes`` (else the run waits as above, for the first
node that brings the world back to ``min_nodes``).  A lost node takes ``replica_nodes`` out
of the world (a data-parallel replica's nodes: the replica cannot train without it; each
loss is taken to hit a replica of its own).  The run keeps its global batch (each rank does
more micro-batches), so a step on ``n`` of the ``N`` nodes takes ``step_s x N / n /
shrink_efficiency``; the part beyond ``step_s`` is the step's ``capacity_s``.  The node that
takes the lost one's rank arrives when it would have ended the wait (a spare repaired, a node
from outside), and the run grows back at its first checkpoint after the node arrived: a
planned restart from that checkpoint (once it is written), costing the restart time of the
kind that needs a node; a restart for a fault takes the nodes that have arrived at once.
The fault rate stays the whole job's while shrunk (one replica of many makes little
difference), and the fault clock runs while training only, so no fault comes during the
planned restart either.
Deterministic for a seed.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field, replace

from trainwarden.agent.core.bounds import bound, bounded, check, cross_check
from trainwarden.supervisor.goodput.ettr import (
    Breakdown,
    CheckpointSaved,
    EttrAccumulator,
    Event,
    Incident,
    RestartDecided,
    Resumed,
    StepDone,
)


@dataclass(frozen=True)
class FaultKind:
    name: str  # an incident kind: crash | hang | loss_spike ...
    share: float  # of all faults
    detect_s: float  # fault -> incident
    restart_s: float  # incident -> the new attempt's first step begins
    trains_until_detected: bool = False  # a loss spike: the steps go on (and are lost)
    needs_node: bool = False  # a node died for good: restarts once a node takes its rank


# Llama 3 405B pre-training: about 78% of its 419 unexpected interruptions were attributed to
# confirmed or suspected hardware issues (GPUs, host components, silent data corruption,
# unplanned host maintenance): Dubey et al. 2024, "The Llama 3 Herd of Models", section
# 3.3.4, Table 5.
LLAMA3_HARDWARE_SHARE = 0.78


def with_node_losses(kinds: tuple[FaultKind, ...], *, detect_s: float, restart_s: float,
                     share: float = LLAMA3_HARDWARE_SHARE) -> tuple[FaultKind, ...]:
    """``kinds`` scaled to ``1 - share`` of the faults, beside a ``node_lost`` kind of
    ``share``: a node that died for good, detected ``detect_s`` after (the node-lost
    deadline), whose gang restarts in ``restart_s`` once a node takes its rank."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"with_node_losses: share must be in [0, 1] (got {share})")
    scaled = tuple(replace(k, share=k.share * (1.0 - share)) for k in kinds)
    return (*scaled, FaultKind("node_lost", share, detect_s, restart_s, needs_node=True))


@dataclass(frozen=True)
class SimConfig:
    mtbf_s: float = field(metadata=bound(gt=0))  # of the whole job; math.inf: no faults
    days: float = field(metadata=bound(gt=0))
    step_s: float = field(metadata=bound(gt=0))
    interval_s: float = field(metadata=bound(gt=0))
    stall_s: float = field(metadata=bound(ge=0))
    kinds: tuple[FaultKind, ...]
    startup_s: float = 0.0
    seed: int = 0
    # an asynchronous save's background write (0: a synchronous save)
    write_s: float = bounded(0.0, ge=0)
    # warm spare nodes at the start (for the faults of a kind that ``needs_node``)
    spares: int = bounded(0, ge=0, integer=True)
    # no spare free: a node from outside the pool arrives this long after the detection
    # (0: at once, a node is always at hand)
    replace_s: float = bounded(0.0, ge=0)
    # a dead node swapped for a spare rejoins the spares this long after the detection
    repair_s: float = bounded(0.0, ge=0)
    # the full world, in nodes (what ``min_nodes`` and ``replica_nodes`` are counted against)
    nodes: int = bounded(1, ge=1, integer=True)
    # the smallest world the run trains on (the run's ``--min-nodes``); None: the full world,
    # a node loss with no spare free waits for a node (no shrinking)
    min_nodes: int | None = bounded(None, ge=1, integer=True,
                                    hint="leave it unset not to shrink")
    # nodes a lost node takes out of the world (a data-parallel replica's)
    replica_nodes: int = bounded(1, ge=1, integer=True)
    # a shrunk world's throughput per node against the full world's (1: a step on n of N
    # nodes takes N / n as long)
    shrink_efficiency: float = bounded(1.0, gt=0, le=1)

    def __post_init__(self) -> None:
        check(self)
        shares = sum(k.share for k in self.kinds)
        cross_check(bool(self.kinds) and abs(shares - 1.0) <= 1e-6, self, "kinds",
                    "fault kinds whose shares add up to 1", got=round(shares, 6),
                    hint="scale the shares")
        cross_check(self.min_nodes is None or self.min_nodes <= self.nodes, self, "min_nodes",
                    f"<= nodes ({self.nodes})", got=self.min_nodes,
                    hint="set nodes to the full world, or leave min_nodes unset not to shrink")
        cross_check(self.nodes % self.replica_nodes == 0, self, "replica_nodes",
                    f"a divisor of nodes ({self.nodes})", got=self.replica_nodes,
                    hint="the world is a whole number of data-parallel replicas")

    @property
    def shrinks(self) -> bool:
        """Whether a node loss can restart the gang on fewer nodes."""
        return self.min_nodes is not None and self.min_nodes <= self.nodes - self.replica_nodes

    @property
    def grow_s(self) -> float:
        """The planned restart back to a larger world: the restart of a kind that needs a
        node (the same gang restart, with no fault to detect)."""
        return next((k.restart_s for k in self.kinds if k.needs_node), 0.0)

    @property
    def restart_overhead_s(self) -> float:
        """Mean fault-to-training time over the kinds (Meta's u0)."""
        return sum(k.share * (k.detect_s + k.restart_s) for k in self.kinds)


@dataclass(frozen=True)
class NodeStats:
    """The faults that needed a node, and what getting one cost."""

    losses: int = 0  # faults of a kind that ``needs_node``
    waits: int = 0  # of them, those that found no spare free and waited for a node
    wait_s: float = 0.0  # time waited for a node, up to the end of the run
    from_outside: int = 0  # nodes that came from outside the pool (``replace_s``)
    fewest_free: int | None = None  # spares left free after a loss, at the lowest
    shrinks: int = 0  # of the losses, those that restarted on fewer nodes instead of waiting
    grows: int = 0  # planned restarts back to a larger world
    grow_s: float = 0.0  # their time, decision to the first step, up to the end of the run
    shrunk_s: float = 0.0  # step time trained on fewer nodes than the full world
    fewest_nodes: int | None = None  # the smallest world trained on (None: never shrunk)


@dataclass(frozen=True)
class SimResult:
    config: SimConfig
    breakdown: Breakdown
    faults: dict[str, int]
    events: int
    nodes: NodeStats = field(default_factory=NodeStats)


class _Pool:
    """The spare nodes: free ones, and dead ones in repair (when each rejoins)."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.free = cfg.spares
        self.repairing: list[float] = []  # a heap of the times repaired nodes rejoin
        self.stats = NodeStats()

    def take(self, t: float) -> tuple[float, bool]:
        """When a node takes the rank of a node whose loss was detected at ``t``, and whether
        it comes from the pool (else from outside)."""
        while self.repairing and self.repairing[0] <= t:
            heapq.heappop(self.repairing)
            self.free += 1
        outside = t + self.cfg.replace_s
        if self.free > 0:
            self.free -= 1
            ready, from_pool = t, True
        elif self.repairing and self.repairing[0] <= outside:
            ready, from_pool = heapq.heappop(self.repairing), True
        else:
            ready, from_pool = outside, False
        if from_pool:  # the dead node goes to repair (one from outside takes its place)
            heapq.heappush(self.repairing, t + self.cfg.repair_s)
        return ready, from_pool

    def record(self, t: float, start: float, from_pool: bool, horizon: float, *,
               shrank: bool) -> None:
        """A loss detected at ``t`` whose restart began at ``start`` (a wait when later)."""
        s = self.stats
        self.stats = replace(
            s, losses=s.losses + 1, waits=s.waits + (start > t),
            wait_s=s.wait_s + max(0.0, min(start, horizon) - min(t, horizon)),
            from_outside=s.from_outside + (not from_pool),
            fewest_free=self.free if s.fewest_free is None else min(s.fewest_free, self.free),
            shrinks=s.shrinks + shrank)

    def note(self, **add: float) -> None:
        """Add to the shrink counters (``grows``, ``grow_s``, ``shrunk_s``)."""
        self.stats = replace(self.stats, **{k: getattr(self.stats, k) + v
                                            for k, v in add.items()})


class _World:
    """The nodes the gang trains on: the full world less a replica per lost node whose
    replacement has not joined yet (only ever short when shrinking)."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.coming: list[float] = []  # a heap: when each missing node's replacement arrives

    @property
    def nodes(self) -> int:
        return self.cfg.nodes - self.cfg.replica_nodes * len(self.coming)

    def step_s(self) -> float:
        """A step's wall time on this world: the global batch kept, so N / n times longer."""
        if not self.coming:
            return self.cfg.step_s  # (exactly: a full world's run is unchanged to the bit)
        return self.cfg.step_s * self.cfg.nodes / (self.nodes * self.cfg.shrink_efficiency)

    def arrived(self, t: float) -> bool:
        return bool(self.coming) and self.coming[0] <= t

    def join(self, t: float) -> None:
        """The gang restarts at ``t``: every node arrived by then joins."""
        while self.arrived(t):
            heapq.heappop(self.coming)

    def lose(self, t: float, ready: float) -> float:
        """A node lost at ``t`` whose replacement arrives at ``ready``: when the gang can
        restart (at once on fewer nodes where ``min_nodes`` allows, else once enough nodes
        arrived)."""
        if ready <= t:
            return t
        heapq.heappush(self.coming, ready)
        need = self.cfg.min_nodes if self.cfg.shrinks else self.cfg.nodes
        assert need is not None
        short = -(-(need - self.nodes) // self.cfg.replica_nodes)  # replicas to wait for
        return t if short <= 0 else heapq.nsmallest(short, self.coming)[-1]


def events(cfg: SimConfig) -> list[Event]:
    """The run's events in time order (see the module docstring)."""
    return _run(cfg)[0]


def _run(cfg: SimConfig) -> tuple[list[Event], NodeStats]:
    rng = random.Random(cfg.seed)
    pool = _Pool(cfg)
    world = _World(cfg)
    horizon = cfg.days * 86_400.0
    names = list(cfg.kinds)
    weights = [k.share for k in cfg.kinds]

    def next_fault(t: float) -> float:
        return math.inf if math.isinf(cfg.mtbf_s) else t + rng.expovariate(1.0 / cfg.mtbf_s)

    out: list[Event] = []
    t, attempt, step = cfg.startup_s, 0, 0
    saves: list[tuple[float, int]] = [(0.0, 0)]  # (completed at, step): newest last
    writing: CheckpointSaved | None = None  # the asynchronous save being written
    last_save = t
    fault = next_fault(t)
    shrunk_s, fewest = 0.0, cfg.nodes  # step time on fewer nodes; the smallest world

    def written(upto: float) -> None:  # the save being written completes before ``upto``
        nonlocal writing
        if writing is not None and writing.t <= upto:
            out.append(writing)
            writing = None

    while t < horizon:
        step_s = world.step_s()
        extra = step_s - cfg.step_s  # a shrunk world's capacity loss (0 at the full world)
        if fault < t + step_s:  # it hits the step in flight (or the save before it)
            written(fault)
            writing = None  # a save still being written is lost
            kind = rng.choices(names, weights)[0]
            detected = fault + kind.detect_s
            target = max(s for at, s in saves if at <= fault)
            if kind.trains_until_detected:
                while t + step_s <= detected:
                    t += step_s
                    out.append(StepDone(attempt, step, t, step_s, capacity_s=extra))
                    step += 1
                target = max((s for at, s in saves if at <= fault), default=0)
            out.append(Incident(detected, kind.name, t_fault=fault))
            attempt += 1
            out.append(RestartDecided(detected, attempt, resume_step=target))
            if kind.trains_until_detected:  # the step in flight ends, late, while stopping
                out.append(StepDone(attempt - 1, step, t + step_s, step_s, capacity_s=extra))
            start = detected
            if kind.needs_node:
                ready, from_pool = pool.take(detected)
                start = world.lose(detected, ready)  # ready, unless the run shrinks
                pool.record(detected, start, from_pool, horizon,
                            shrank=detected == start < ready)
            world.join(start)  # (a restart takes every node arrived by then)
            fewest = min(fewest, world.nodes)
            t = start + kind.restart_s
            out.append(Resumed(t, attempt, target))
            step, last_save = target, t
            saves = [(at, s) for at, s in saves if s <= target][-2:]
            fault = next_fault(t)
            continue
        written(t + step_s)
        t += step_s
        out.append(StepDone(attempt, step, t, step_s, capacity_s=extra))
        step += 1
        if extra:
            shrunk_s += step_s
        if t - last_save >= cfg.interval_s:
            wait = 0.0 if writing is None else writing.t - t  # one save in flight at a time
            if fault < t + wait + cfg.stall_s:
                continue  # the fault hits first (the next round of the loop meets it)
            written(t + wait)
            stall = wait + cfg.stall_s
            t += stall
            if cfg.write_s > 0:
                writing = CheckpointSaved(t + cfg.write_s, step, stall, released_at=t)
            else:
                out.append(CheckpointSaved(t, step, stall))
            saves = [*saves[-2:], (t + cfg.write_s, step)]
            last_save = t
            if world.arrived(t - stall):  # a node came: grow back from this checkpoint
                attempt += 1
                out.append(RestartDecided(t, attempt, resume_step=step))
                written(t + cfg.write_s)  # (the restart loads it once it is written)
                world.join(t)
                resumed = t + cfg.write_s + cfg.grow_s
                pool.note(grows=1, grow_s=max(0.0, min(resumed, horizon) - min(t, horizon)))
                out.append(Resumed(resumed, attempt, step))
                fault += resumed - t  # the fault clock stops while the gang restarts
                t = last_save = resumed
    stats = pool.stats
    if cfg.shrinks:
        stats = replace(stats, shrunk_s=shrunk_s,
                        fewest_nodes=fewest if fewest < cfg.nodes else None)
    return out, stats


def simulate(cfg: SimConfig) -> SimResult:
    acc = EttrAccumulator(start=0.0)
    evs, nodes = _run(cfg)
    faults: dict[str, int] = {}
    for e in evs:
        acc.feed(e)
        if isinstance(e, Incident):
            faults[e.kind] = faults.get(e.kind, 0) + 1
    end = max(cfg.days * 86_400.0, acc.cursor)
    return SimResult(config=cfg, breakdown=acc.snapshot(now=end), faults=faults,
                     events=len(evs), nodes=nodes)

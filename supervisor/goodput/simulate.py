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

    def __post_init__(self) -> None:
        check(self)
        shares = sum(k.share for k in self.kinds)
        cross_check(bool(self.kinds) and abs(shares - 1.0) <= 1e-6, self, "kinds",
                    "fault kinds whose shares add up to 1", got=round(shares, 6),
                    hint="scale the shares")

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

    def node_at(self, t: float, horizon: float) -> float:
        """When a node takes the rank of a node whose loss was detected at ``t``."""
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
        s = self.stats
        self.stats = NodeStats(
            losses=s.losses + 1, waits=s.waits + (ready > t),
            wait_s=s.wait_s + max(0.0, min(ready, horizon) - min(t, horizon)),
            from_outside=s.from_outside + (not from_pool),
            fewest_free=self.free if s.fewest_free is None else min(s.fewest_free, self.free))
        return ready


def events(cfg: SimConfig) -> list[Event]:
    """The run's events in time order (see the module docstring)."""
    return _run(cfg)[0]


def _run(cfg: SimConfig) -> tuple[list[Event], NodeStats]:
    rng = random.Random(cfg.seed)
    pool = _Pool(cfg)
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

    def written(upto: float) -> None:  # the save being written completes before ``upto``
        nonlocal writing
        if writing is not None and writing.t <= upto:
            out.append(writing)
            writing = None

    while t < horizon:
        if fault < t + cfg.step_s:  # it hits the step in flight (or the save before it)
            written(fault)
            writing = None  # a save still being written is lost
            kind = rng.choices(names, weights)[0]
            detected = fault + kind.detect_s
            target = max(s for at, s in saves if at <= fault)
            if kind.trains_until_detected:
                while t + cfg.step_s <= detected:
                    t += cfg.step_s
                    out.append(StepDone(attempt, step, t, cfg.step_s))
                    step += 1
                target = max((s for at, s in saves if at <= fault), default=0)
            out.append(Incident(detected, kind.name, t_fault=fault))
            attempt += 1
            out.append(RestartDecided(detected, attempt, resume_step=target))
            if kind.trains_until_detected:  # the step in flight ends, late, while stopping
                out.append(StepDone(attempt - 1, step, t + cfg.step_s, cfg.step_s))
            ready = pool.node_at(detected, horizon) if kind.needs_node else detected
            t = ready + kind.restart_s
            out.append(Resumed(t, attempt, target))
            step, last_save = target, t
            saves = [(at, s) for at, s in saves if s <= target][-2:]
            fault = next_fault(t)
            continue
        written(t + cfg.step_s)
        t += cfg.step_s
        out.append(StepDone(attempt, step, t, cfg.step_s))
        step += 1
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
    return out, pool.stats


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

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
Deterministic for a seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

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
class SimResult:
    config: SimConfig
    breakdown: Breakdown
    faults: dict[str, int]
    events: int


def events(cfg: SimConfig) -> list[Event]:
    """The run's events in time order (see the module docstring)."""
    rng = random.Random(cfg.seed)
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
            t = detected + kind.restart_s
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
    return out


def simulate(cfg: SimConfig) -> SimResult:
    acc = EttrAccumulator(start=0.0)
    evs = events(cfg)
    faults: dict[str, int] = {}
    for e in evs:
        acc.feed(e)
        if isinstance(e, Incident):
            faults[e.kind] = faults.get(e.kind, 0) + 1
    end = max(cfg.days * 86_400.0, acc.cursor)
    return SimResult(config=cfg, breakdown=acc.snapshot(now=end), faults=faults,
                     events=len(evs))

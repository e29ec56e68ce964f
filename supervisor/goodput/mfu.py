"""MFU bands, per-rank step shares and scaling efficiency, diagnosed from phase times.

MFU bands.  The published rules of thumb for dense transformer training name four ranges:
40-50% healthy; 25-35% communication not overlapped, or activation recomputation (its FLOPs
are not counted as model FLOPs); 10-20% the data loader, or a batch per device too small to
fill the device; under 10% work on the CPU side or a synchronisation every step.  The ranges
leave gaps; the bands here split each gap at its middle (37.5% and 22.5%) so that every value
falls in exactly one band and a value near a published edge reads as its nearest range.
Above 50% is better than typical large runs ("excellent"); from 75% up the number is more
likely wrong than great (dense training does not sustain it: check the declared FLOPs per
sample or token and the peak FLOP/s per rank).

Per rank, from the mean phase times over a window of steps (``rank_steps``): the share of
the step spent waiting for data (``data_s / step_s``), computing before the first blocking
collective (``compute_s / step_s``) and the rest (``1 - data - compute``: the collective
itself, waiting there for slower ranks, the optimizer step), called ``comm`` here.  With the
FLOPs a rank does per step and its peak: the rank's MFU (over its whole step; equal across
ranks of a synchronous job) and its compute utilisation (over its compute phase only: low on
a rank whose device is slow, normal on a rank slow because of its data).

Scaling efficiency = throughput on N devices / (N x throughput on one), when the run
declares the one-device throughput (or a baseline run's).  The usual causes of a shortfall,
in the order they are usually found, each with the evidence for or against it from the
run's own phase times (thresholds in ``ScalingConfig``):

1. the data loader: the median rank waits for data for a large share of the step;
2. the batch per device: the compute of a step is so short that fixed per-step costs
   (kernel launches, collective latency) dominate it;
3. the interconnect: a large share of a step of real compute remains after the slowest rank
   reached the collective (the wait before that is the straggler's, not the network's);
4. one straggler: the slowest rank's pre-collective time is well above the median rank's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from trainwarden.agent.core.bounds import bounded, check
from trainwarden.supervisor.detect._stats import median


@dataclass(frozen=True)
class Band:
    name: str
    low: float  # inclusive
    high: float  # exclusive
    meaning: str


BANDS = (
    Band("check_declaration", 0.75, math.inf,
         "above what dense training sustains: check the declared FLOPs per sample/token and "
         "the peak FLOP/s per rank"),
    Band("excellent", 0.50, 0.75, "better than typical large runs"),
    Band("healthy", 0.375, 0.50, "what a well-tuned large run reaches (40-50%)"),
    Band("communication", 0.225, 0.375,
         "25-35%: communication not overlapped with compute, or activation recomputation "
         "(recomputed FLOPs are not model FLOPs)"),
    Band("input_or_batch", 0.10, 0.225,
         "10-20%: the data loader cannot keep up, or the batch per device is too small to "
         "fill the device"),
    Band("host_bound", 0.0, 0.10,
         "under 10%: work on the CPU side (Python overhead, unfused ops, host-device copies) "
         "or a synchronisation every step (.item(), a blocking log or metric)"),
)


def band(mfu: float) -> Band:
    """The band an MFU (a ratio, 0.42 for 42%) falls in."""
    if not math.isfinite(mfu) or mfu < 0:
        raise ValueError(f"MFU must be a finite ratio >= 0, got {mfu}")
    return next(b for b in BANDS if b.low <= mfu < b.high)


def mfu_factor(declared: Mapping[str, Any] | None, ranks: Any) -> tuple[str, float] | None:
    """(unit, factor): MFU = throughput in ``unit`` ("samples" or "tokens") per second x
    factor, from a ``flops_declared`` event's details and the ranks reporting; None when
    not declared."""
    if not declared or not isinstance(ranks, int) or ranks < 1:
        return None
    peak = declared.get("peak_flops_per_rank")
    if not isinstance(peak, int | float) or peak <= 0:
        return None
    for unit, key in (("samples", "flops_per_sample"), ("tokens", "flops_per_token")):
        flops = declared.get(key)
        if isinstance(flops, int | float) and flops > 0:
            return unit, float(flops) / (ranks * float(peak))
    return None


def mfu(declared: Mapping[str, Any] | None, throughput: Mapping[str, Any]) -> float | None:
    """The run's model FLOPs utilisation: throughput x declared FLOPs per sample (or token)
    / (ranks x declared peak FLOP/s per rank), from ``reads.throughput``'s figures; None
    when not declared or not measurable yet."""
    factor = mfu_factor(declared, throughput.get("ranks"))
    if factor is None:
        return None
    rate = throughput.get("samples_per_s" if factor[0] == "samples" else "tokens_per_s")
    if rate is None:
        return None
    out = float(rate) * factor[1]
    # (a peak no hardware has, 5e-324 FLOP/s, makes it infinite: no MFU, not a band error)
    return out if math.isfinite(out) and out >= 0 else None


@dataclass(frozen=True)
class RankPhases:
    """One rank's mean phase times (seconds per step) over a window of steps."""

    rank: int
    data_s: float | None
    compute_s: float | None
    step_s: float | None


@dataclass(frozen=True)
class RankShare:
    rank: int
    step_s: float | None
    data: float | None  # shares of the step
    compute: float | None
    comm: float | None  # collective, waiting for peers, optimizer step
    mfu: float | None
    compute_utilisation: float | None


def _ok(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0


def rank_share(p: RankPhases, *, flops_per_rank_step: float | None = None,
               peak_flops_per_rank: float | None = None) -> RankShare:
    step = p.step_s if _ok(p.step_s) and p.step_s else None
    data = min(1.0, p.data_s / step) if step and p.data_s is not None and _ok(p.data_s) \
        else None
    compute = (min(1.0, p.compute_s / step)
               if step and p.compute_s is not None and _ok(p.compute_s) else None)
    comm = max(0.0, 1.0 - (data or 0.0) - compute) if compute is not None else None
    work = (flops_per_rank_step / peak_flops_per_rank
            if flops_per_rank_step and peak_flops_per_rank else None)  # seconds at peak
    mfu = work / step if work is not None and step else None
    cu = (work / p.compute_s if work is not None and p.compute_s and _ok(p.compute_s)
          else None)
    return RankShare(rank=p.rank, step_s=step, data=data, compute=compute, comm=comm, mfu=mfu,
                     compute_utilisation=cu)


@dataclass(frozen=True)
class MfuDiagnosis:
    mfu: float | None
    band: Band | None
    ranks: tuple[RankShare, ...]
    data_share: float | None  # median over ranks
    comm_share: float | None
    # A figure above 100% (the run's MFU or a rank's): the declaration is off, not the device
    declaration_warning: str | None = None

    def as_dict(self) -> dict[str, object]:
        return {"mfu": self.mfu, "band": asdict(self.band) if self.band else None,
                "data_share": self.data_share, "comm_share": self.comm_share,
                "ranks": [asdict(r) for r in self.ranks],
                "declaration_warning": self.declaration_warning}


def _median_of(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return median(vals) if vals else None


def diagnose_mfu(mfu: float | None, ranks: Sequence[RankPhases], *,
                 flops_per_rank_step: float | None = None,
                 peak_flops_per_rank: float | None = None) -> MfuDiagnosis:
    """The run's band and every rank's shares (``mfu``: the run's, None when undeclared)."""
    shares = tuple(rank_share(p, flops_per_rank_step=flops_per_rank_step,
                              peak_flops_per_rank=peak_flops_per_rank)
                   for p in sorted(ranks, key=lambda p: p.rank))
    return MfuDiagnosis(mfu=mfu, band=band(mfu) if mfu is not None else None, ranks=shares,
                        data_share=_median_of([s.data for s in shares]),
                        comm_share=_median_of([s.comm for s in shares]),
                        declaration_warning=declaration_warning(mfu, shares))


def declaration_warning(mfu: float | None, shares: Sequence[RankShare]) -> str | None:
    """What a figure above 100% means: no device runs above its peak, so the declared peak
    FLOP/s per rank is too low (or the FLOPs per sample or token too high).  None when every
    figure is at most 100%."""
    over = [f"the run's MFU {mfu:.0%}"] if mfu is not None and mfu > 1.0 else []
    for s in shares:
        for name, x in (("MFU", s.mfu), ("compute utilisation", s.compute_utilisation)):
            if x is not None and x > 1.0:
                over.append(f"rank {s.rank}'s {name} {x:.0%}")
    if not over:
        return None
    return (f"{', '.join(over[:4])}{' and more' if len(over) > 4 else ''}: above 100%, which no "
            "device reaches, so the declaration is off: the declared peak FLOP/s per rank is "
            "lower than the device's (or the FLOPs per sample/token are too high); fix "
            "declare_flops(...)")


# --------------------------------------------------------------------------------------------
# Scaling


@dataclass(frozen=True)
class ScalingConfig:
    # median data wait above this share of the step: a cause
    data_share: float = bounded(0.10, gt=0, lt=1)
    # a step's compute shorter than this: fixed costs dominate
    small_compute_s: float = bounded(0.05, gt=0)
    # median comm share above this (with real compute): a cause
    comm_share: float = bounded(0.25, gt=0, lt=1)
    # slowest - median pre-collective, as a share of the step
    straggler_share: float = bounded(0.10, gt=0, lt=1)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class Cause:
    name: Literal["data_loader", "batch_per_device", "interconnect", "straggler"]
    verdict: Literal["for", "against", "unknown"]
    share: float | None  # of the step, where the cause has one
    evidence: str


@dataclass(frozen=True)
class Scaling:
    efficiency: float | None
    devices: int
    causes: tuple[Cause, ...]
    likely: str | None  # the first cause with evidence for it, in the usual order

    def as_dict(self) -> dict[str, object]:
        return {"efficiency": self.efficiency, "devices": self.devices,
                "likely": self.likely, "causes": [asdict(c) for c in self.causes]}


def scaling_efficiency(throughput: float, devices: int, baseline_per_device: float) -> float:
    """Throughput on ``devices`` / (devices x one device's throughput)."""
    if devices < 1 or not baseline_per_device > 0 or not throughput >= 0:
        raise ValueError("scaling_efficiency needs devices >= 1, a baseline > 0 and a "
                         "throughput >= 0")
    return throughput / (devices * baseline_per_device)


def diagnose_scaling(ranks: Sequence[RankPhases], *, devices: int,
                     throughput: float | None = None,
                     baseline_per_device: float | None = None,
                     expected_sync_s: float | None = None,
                     config: ScalingConfig | None = None) -> Scaling:
    """Scaling efficiency (when a baseline is declared) and the usual causes, checked against
    the per-rank phase times; ``expected_sync_s``: the gradient sync the interconnect should
    take per step (``plan``), quoted next to the measured communication."""
    cfg = config or ScalingConfig()
    eff = (scaling_efficiency(throughput, devices, baseline_per_device)
           if throughput is not None and baseline_per_device else None)
    shares = [rank_share(p) for p in ranks]
    step = _median_of([s.step_s for s in shares])
    data = _median_of([s.data for s in shares])
    comm = _median_of([s.comm for s in shares])
    compute_s = _median_of([p.compute_s if _ok(p.compute_s) else None for p in ranks])
    pres = {p.rank: p.data_s + p.compute_s for p in ranks
            if p.data_s is not None and p.compute_s is not None
            and _ok(p.data_s) and _ok(p.compute_s)}
    # The collective proper starts when the slowest rank arrives; the fast ranks' wait
    # before that is the straggler's, not the network's.
    net = max(0.0, step - max(pres.values())) / step if pres and step else None
    causes = [_data_cause(cfg, data, shares), _batch_cause(cfg, compute_s, comm),
              _interconnect_cause(cfg, compute_s, net, step, expected_sync_s),
              _straggler_cause(cfg, pres, step)]
    likely = next((c.name for c in causes if c.verdict == "for"), None)
    return Scaling(efficiency=eff, devices=devices, causes=tuple(causes), likely=likely)


def _data_cause(cfg: ScalingConfig, data: float | None, shares: list[RankShare]) -> Cause:
    if data is None:
        return Cause("data_loader", "unknown", None, "no data wait reported (data_s)")
    worst = max((s for s in shares if s.data is not None), key=lambda s: s.data or 0.0)
    text = (f"the median rank waits {data:.0%} of the step for its batch (rank {worst.rank}: "
            f"{worst.data:.0%})")
    return Cause("data_loader", "for" if data >= cfg.data_share else "against", data,
                 text + (f"; over {cfg.data_share:.0%} is a loader that cannot keep up"
                         if data >= cfg.data_share else ""))


def _batch_cause(cfg: ScalingConfig, compute_s: float | None, comm: float | None) -> Cause:
    if compute_s is None:
        return Cause("batch_per_device", "unknown", None,
                     "no compute time reported (compute_s: PhaseTimer.compute_done)")
    small = compute_s < cfg.small_compute_s
    text = (f"a step computes for {compute_s * 1000:.1f} ms (median rank)"
            + (f", communication and the rest take {comm:.0%} of it" if comm is not None
               else ""))
    return Cause("batch_per_device", "for" if small else "against", comm,
                 text + (f"; under {cfg.small_compute_s * 1000:.0f} ms per-step fixed costs "
                         "dominate: a larger batch per device amortises them" if small
                         else ": enough work per step to amortise fixed per-step costs"))


def _interconnect_cause(cfg: ScalingConfig, compute_s: float | None, net: float | None,
                        step: float | None, expected_sync_s: float | None) -> Cause:
    if net is None or compute_s is None:
        return Cause("interconnect", "unknown", None,
                     "no compute time reported: the communication share is unknown")
    heavy = net >= cfg.comm_share and compute_s >= cfg.small_compute_s
    text = (f"after the slowest rank reaches the collective, {net:.0%} of the step remains "
            "(the collective and the optimizer step)")
    if expected_sync_s is not None and step:
        text += (f"; {net * step:.3f} s measured against {expected_sync_s:.3f} s the "
                 "gradient all-reduce takes on the declared interconnect")
    return Cause("interconnect", "for" if heavy else "against", net,
                 text + (f"; over {cfg.comm_share:.0%} with real compute points at the "
                         "network (or a sync not overlapped with compute)" if heavy else ""))


def _straggler_cause(cfg: ScalingConfig, pres: dict[int, float],
                     step: float | None) -> Cause:
    if len(pres) < 2 or not step:
        return Cause("straggler", "unknown", None,
                     "fewer than two ranks with data and compute times")
    slow = max(pres, key=lambda r: pres[r])
    excess = (pres[slow] - median(pres.values())) / step
    slow_one = excess >= cfg.straggler_share
    return Cause("straggler", "for" if slow_one else "against", excess,
                 f"rank {slow} is {excess:.0%} of a step behind the median rank before the "
                 "collective" + ("; the others wait for it every step" if slow_one else ""))

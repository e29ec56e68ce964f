"""Throughput decay: the run trains markedly slower than it itself did earlier.

Rate of a step = amount trained (tokens, or samples, summed over ranks) / seconds (the step's
wall time, or the interval since the previous step).  Reference: the median rate over an early
window of the run, after ``warmup_steps`` (start-up, compilation and cache warm-up make the
first steps slow).  Recent: the median rate over the newest ``window_steps`` steps.  A recent
median below ``(1 - drop)`` x the reference is an event (``throughput_decay``): the data
pipeline, a straggler, thermal throttling or a noisy neighbour.  It is an event, not an
incident: the run still makes progress, and the cause is for a person (or the straggler
detector) to name.

Medians make it sustained by construction: more than half the recent window must be slow, so a
checkpoint save or an evaluation pass (single slow steps) does not count.  ``drop = 0.30`` is
well outside step-to-step noise and slow drift, and well inside what a real problem costs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.supervisor.detect._stats import median
from trainwarden.supervisor.detect.findings import EVENT, Finding, FindingKind


@dataclass(frozen=True)
class ThroughputPoint:
    step: int
    amount: float  # tokens (or samples) trained at this step, all ranks together
    seconds: float  # wall time of the step (or the interval since the previous one)

    @property
    def rate(self) -> float | None:
        if self.seconds > 0 and math.isfinite(self.seconds) and math.isfinite(self.amount):
            return self.amount / self.seconds
        return None


@dataclass(frozen=True)
class ThroughputConfig:
    SECTION: ClassVar[str] = "throughput"

    # recent below (1 - drop) x reference -> event
    drop: float = bounded(0.30, gt=0, lt=1, hint="try 0.3 for 30%")
    warmup_steps: int = bounded(20, ge=0)  # first steps of the run left out of the reference
    reference_steps: int = 100  # the reference window, after warm-up
    window_steps: int = 50  # the recent window
    min_points: int = bounded(20, ge=1)  # rates needed in each window
    unit: str = "tokens/s"  # for messages only
    # consecutive normal steps that end the slow stretch (onset search)
    onset_gap: int = bounded(3, ge=1)

    def __post_init__(self) -> None:
        check(self)
        for name in ("reference_steps", "window_steps"):
            cross_check(getattr(self, name) >= self.min_points, self, name,
                        f">= min_points = {self.min_points}", got=getattr(self, name),
                        hint="lower min_points or widen the window")


def reference_range(first_step: int, cfg: ThroughputConfig | None = None) -> tuple[int, int]:
    """Inclusive step range of the reference window for a run whose first step is
    ``first_step`` (what the evaluator fetches once to build the reference)."""
    cfg = cfg or ThroughputConfig()
    a = first_step + cfg.warmup_steps
    return a, a + cfg.reference_steps - 1


def reference_rate(points: Sequence[ThroughputPoint], cfg: ThroughputConfig | None = None
                   ) -> float | None:
    """Median rate of the given reference points (None with fewer than ``min_points``)."""
    cfg = cfg or ThroughputConfig()
    rates = [r for p in points if (r := p.rate) is not None]
    return median(rates) if len(rates) >= cfg.min_points else None


def detect_throughput_decay(points: Sequence[ThroughputPoint], *,
                            reference: float | Sequence[ThroughputPoint] | None = None,
                            cfg: ThroughputConfig | None = None) -> list[Finding]:
    """A ``throughput_decay`` event when the recent median rate fell by more than ``drop``.

    ``points``: the newest steps, ordered by step (the newest ``window_steps`` are judged; older
    ones help place the onset).  ``reference``: the reference rate, or reference points (see
    ``reference_range``), or None to take it from ``points`` themselves (then ``points`` must
    hold warm-up + reference + recent steps from the start of the run)."""
    cfg = cfg or ThroughputConfig()
    pts = sorted((p for p in points if p.rate is not None), key=lambda p: p.step)
    recent = pts[-cfg.window_steps:]
    if len(recent) < cfg.min_points:
        return []
    if reference is None:
        early = pts[cfg.warmup_steps: cfg.warmup_steps + cfg.reference_steps]
        if len(early) < cfg.min_points or early[-1].step >= recent[0].step:
            return []  # not enough history yet: the reference would overlap the recent window
        ref = reference_rate(early, cfg)
    elif isinstance(reference, int | float):
        ref = float(reference)
    else:
        ref = reference_rate(reference, cfg)
    if ref is None or not ref > 0:
        return []
    now_rate = median(p.rate for p in recent if p.rate is not None)
    limit = (1.0 - cfg.drop) * ref
    if now_rate >= limit:
        return []
    onset = _onset(pts, limit, cfg.onset_gap)
    ratio = now_rate / ref
    details: dict[str, Any] = {
        "reference_rate": ref, "recent_rate": now_rate, "ratio": round(ratio, 4),
        "drop_pct": round(100 * (1 - ratio), 1), "threshold_pct": round(100 * cfg.drop, 1),
        "unit": cfg.unit, "window": [recent[0].step, recent[-1].step],
    }
    msg = (f"throughput decay: {now_rate:,.1f} {cfg.unit} over steps {recent[0].step}-"
           f"{recent[-1].step} vs reference {ref:,.1f} {cfg.unit} "
           f"({100 * (1 - ratio):.0f}% lower, threshold {100 * cfg.drop:.0f}%); "
           f"slow since step {onset}")
    return [Finding(kind=FindingKind.THROUGHPUT_DECAY, severity=EVENT, message=msg, step=onset,
                    details=details)]


def _onset(pts: Sequence[ThroughputPoint], limit: float, gap: int) -> int | None:
    onset: int | None = None
    normal = 0
    for p in reversed(pts):
        r = p.rate
        if r is not None and r < limit:
            onset, normal = p.step, 0
        else:
            normal += 1
            if normal >= gap and onset is not None:
                break
    return onset

"""Loss spikes that do not come back by themselves, and non-finite loss or gradient norms.

Baseline: the median and MAD of the loss over the last ``window_steps`` steps that were not
part of a spike (a spike never teaches the baseline that it is normal).  A step is *high* when

    loss > threshold = median + max(z x 1.4826 x MAD, min_rel x |median|, min_abs)

(1.4826 x MAD estimates the standard deviation of normal noise; the relative floor keeps
phases with a tiny MAD, late in training, from calling a small wiggle a spike; ``min_abs``
only matters for a loss stuck at zero).  A spike starts with a clear jump and ends once the
loss is near the baseline again, not merely under the jump's threshold: it is *back* once the
median of the newest ``recover_steps`` losses is at most

    back level = median + max(recover_z x 1.2533 x 1.4826 x MAD / sqrt(recover_steps),
                              recover_rel x |median|, min_abs)

(1.2533 x sigma / sqrt(n) is the standard error of the median of n values: within
``recover_z`` standard errors of the baseline, or within 25% of it).  Per-rank samples are
merged into one loss a step (the mean of the finite values).  Nothing is judged until the
baseline holds ``min_history`` steps.

A spike starts at the first high step; its baseline is frozen there.  It is over once the
median of the newest ``recover_steps`` steps is back; it was back from the first of those
steps (the first after the last high one among them).  Then:

* back within ``recovery_window_steps`` of its start: a transient spike, an event
  (``loss_spike_transient``), never a rollback, unless it had fewer than
  ``transient_min_steps`` high steps (a single outlier batch: nothing);
* not back within ``recovery_window_steps`` and at least ``sustain_steps`` high steps: an
  incident (``loss_spike``, step = the first high step), called at the first step that shows
  it cannot be back in time (``recovery_window_steps`` after the start for a loss that stays
  up).  Only high steps count toward ``sustain_steps``: steps back near the baseline inside
  an open spike do not;
* divergence is called early: once the newest ``rise_steps`` steps are all high and the
  median of their newer half is ``rise_factor`` x that of their older half (a loss that keeps
  rising is not coming back), the spike is an incident at once.

``details["detected_at_step"]`` is the step where the incident's rule first held (the window
ran out, or the rise was seen): the policy sizes a rollback's skip range from the spike's start
to it.  Why wait: a rollback costs a restart, discards the steps since the checkpoint, skips
data and lowers the LR; waiting for a spike that stays costs only the window's steps.  On real
traces (``tests/data/loss_traces``) spikes that came back by themselves did so within a few
tens of steps; ``recovery_window_steps = 50`` lets them.

NaN or Inf in the loss or the gradient norm is an incident (``nonfinite``) at once, naming
the first such step and, when samples are per rank, the ranks; when a spike was open before
it (a loss climbing to NaN), ``details["start_step"]`` is that spike's start.

Why the other defaults: ``z = 6`` is far outside normal noise (and outside most heavy-tailed
noise); ``min_rel = 0.5`` (50% above the median) matches what large-run reports call a spike,
which is a jump of the loss by a large factor; the median of a lagging window stays *above* a
loss that falls quickly (LR warm-up), so a falling curve is never high.

Two ways to call it.  ``detect_loss(samples)`` is a pure function of the window: pass the
newest ``LossSpikeConfig.lookback_steps`` steps of the current lineage.  Its answer for a spike
is stable while the window still holds ``window_steps`` steps from before the spike's start;
later, once the pre-spike history has slid out, a sustained spike is the only history left and
may look like a new one a few steps on.  ``LossSpikeTracker`` is the same scan kept between
calls: it can be fed only the steps not fed yet (cheap), and rebuilt after a restart by
feeding the window once (a fresh tracker fed the window *is* ``detect_loss``).  A tracker
remembers an open spike and the first non-finite step for as long as it lives, so their
findings keep their key.  Deduplicate on ``Finding.key``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.supervisor.detect._stats import MAD_TO_SIGMA, mad, median, median_sorted
from trainwarden.supervisor.detect.findings import (
    EVENT,
    INCIDENT,
    Finding,
    FindingKind,
)

# The standard error of the median of n normal values is about 1.2533 x sigma / sqrt(n).
_MEDIAN_SE = 1.2533


@dataclass(frozen=True)
class LossSample:
    """One loss value: per rank (``rank`` set) or already merged over ranks (``rank`` None).
    Several samples of one step are merged by the mean of their finite losses."""

    step: int
    loss: float | None
    grad_norm: float | None = None
    rank: int | None = None
    t: float | None = None  # unix time of the step, when known


@dataclass(frozen=True)
class LossSpikeConfig:
    SECTION: ClassVar[str] = "loss"

    window_steps: int = bounded(50, ge=3, hint="try 50")  # baseline: the last W non-spike steps
    # baseline steps needed before any step is judged
    min_history: int = bounded(20, ge=3)
    z: float = bounded(6.0, gt=0, hint="try 6")  # robust z-score a high step must exceed ...
    min_rel: float = bounded(0.5, ge=0)  # ... and the median by this fraction
    # ... and by this much in absolute terms (a loss stuck at 0)
    min_abs: float = bounded(1e-6, ge=0)
    # Back: the median of the newest recover_steps losses within recover_z standard errors
    # of a median of that many (1.2533 x 1.4826 x MAD / sqrt(n)) or recover_rel x |median|
    # of the baseline's median.

    # "back": within this many standard errors of the baseline ...
    recover_z: float = bounded(2.0, gt=0)
    recover_rel: float = bounded(0.25, ge=0)  # ... or within this share of its median
    recover_steps: int = bounded(5, ge=1)  # judged on the median of this many newest losses
    recovery_window_steps: int = 50  # a spike back within this many steps is transient
    # high steps a spike not back in the window needs to be one
    sustain_steps: int = bounded(10, ge=1)
    # a spike whose newest N steps are all high and rising ...
    rise_steps: int = bounded(10, ge=4, hint="try 10")
    # ... by this factor (newer half's median / older half's)
    rise_factor: float = bounded(2.0, gt=1, hint="try 2")
    transient_min_steps: int = bounded(2, ge=1)  # fewer high steps: a single outlier, ignored

    def __post_init__(self) -> None:
        check(self)
        cross_check(self.min_history <= self.window_steps, self, "min_history",
                    f"<= window_steps = {self.window_steps}", got=self.min_history)
        cross_check(self.recover_z <= self.z, self, "recover_z", f"<= z = {self.z:g}",
                    got=self.recover_z)
        cross_check(self.recover_rel <= self.min_rel, self, "recover_rel",
                    f"<= min_rel = {self.min_rel:g}", got=self.recover_rel)
        cross_check(self.recovery_window_steps >= self.sustain_steps, self,
                    "recovery_window_steps", f">= sustain_steps = {self.sustain_steps}",
                    got=self.recovery_window_steps,
                    hint="a spike cannot have more high steps than the window holds")
        cross_check(self.transient_min_steps <= self.sustain_steps, self, "transient_min_steps",
                    f"<= sustain_steps = {self.sustain_steps}", got=self.transient_min_steps)

    @property
    def lookback_steps(self) -> int:
        """How many of the newest steps the evaluator should pass on each call: the window
        a spike is judged over, with twice the baseline before it."""
        return 2 * self.window_steps + self.recovery_window_steps + self.recover_steps


def samples_from_pairs(losses: Iterable[tuple[int, float | None]],
                       grad_norms: Iterable[tuple[int, float | None]] = ()) -> list[LossSample]:
    """``[(step, loss)]`` (+ optional ``[(step, grad_norm)]``) as samples."""
    gn = dict(grad_norms)
    out = [LossSample(step=s, loss=x, grad_norm=gn.pop(s, None)) for s, x in losses]
    out.extend(LossSample(step=s, loss=None, grad_norm=g) for s, g in gn.items())
    return out


def detect_loss(samples: Sequence[LossSample], cfg: LossSpikeConfig | None = None
                ) -> list[Finding]:
    """Non-finite values (one finding, the first step), then spikes in step order: a pure
    function of the window."""
    return LossSpikeTracker(cfg).feed(samples)


def detect_spikes(samples: Sequence[LossSample], cfg: LossSpikeConfig | None = None
                  ) -> list[Finding]:
    """Only the ``loss_spike`` incidents and ``loss_spike_transient`` events of the window."""
    return [f for f in detect_loss(samples, cfg) if f.kind != FindingKind.NONFINITE]


def _nonfinite(x: float | None) -> bool:
    return x is not None and not math.isfinite(x)


def detect_nonfinite(samples: Iterable[LossSample]) -> Finding | None:
    """The first step with a NaN or Inf loss or gradient norm, as a ``nonfinite`` incident."""
    bad = [x for x in samples if _nonfinite(x.loss) or _nonfinite(x.grad_norm)]
    if not bad:
        return None
    first = min(x.step for x in bad)
    at = [x for x in bad if x.step == first]
    ranks = sorted({x.rank for x in at if x.rank is not None})
    fields = sorted({f for x in at for f in ("loss", "grad_norm") if _nonfinite(getattr(x, f))})
    values = sorted({repr(getattr(x, f)) for x in at for f in fields
                     if _nonfinite(getattr(x, f))})
    rank = ranks[0] if ranks else None
    where = f"step {first}" + (f" on rank{'s' if len(ranks) > 1 else ''} "
                               f"{', '.join(map(str, ranks[:8]))}" if ranks else "")
    msg = f"non-finite {' and '.join(fields)} ({', '.join(values)}) at {where}"
    t = min((x.t for x in at if x.t is not None), default=None)
    return Finding(kind=FindingKind.NONFINITE, severity=INCIDENT, message=msg, step=first,
                   rank=rank, started_at=t,
                   details={"fields": fields, "values": values, "ranks": ranks,
                            "samples": len(bad), "steps": len({x.step for x in bad})})


@dataclass
class _Point:
    step: int
    loss: float
    grad_norm: float | None
    t: float | None


def _merge(samples: Iterable[LossSample]) -> list[_Point]:
    """One point a step: mean of the finite losses, max of the finite grad norms."""
    acc: dict[int, list[Any]] = {}
    for x in samples:
        a = acc.setdefault(x.step, [0.0, 0, None, None])
        if x.loss is not None and math.isfinite(x.loss):
            a[0] += x.loss
            a[1] += 1
        if x.grad_norm is not None and math.isfinite(x.grad_norm):
            a[2] = x.grad_norm if a[2] is None else max(a[2], x.grad_norm)
        if x.t is not None:
            a[3] = x.t if a[3] is None else max(a[3], x.t)
    return [_Point(s, a[0] / a[1], a[2], a[3]) for s, a in sorted(acc.items()) if a[1]]


class _Baseline:
    """The last W values, kept sorted for the median."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.fifo: deque[float] = deque()
        self.sorted: list[float] = []

    def add(self, x: float) -> None:
        self.fifo.append(x)
        bisect.insort(self.sorted, x)
        if len(self.fifo) > self.size:
            old = self.fifo.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]

    def __len__(self) -> int:
        return len(self.fifo)

    def stats(self, cfg: LossSpikeConfig) -> tuple[float, float, float]:
        """(median, MAD, threshold above which a loss is high)."""
        med = median_sorted(self.sorted)
        m = mad(self.sorted, med)
        thr = med + max(cfg.z * MAD_TO_SIGMA * m, cfg.min_rel * abs(med), cfg.min_abs)
        return med, m, thr


@dataclass
class _Spike:
    start: _Point
    med: float
    mad: float
    thr: float
    back: float  # at or below: back near the baseline
    grad_norm_median: float | None
    last_high: _Point
    peak: _Point
    high_steps: int = 1  # points above the threshold
    points: int = 1  # points since the start
    tail: deque[_Point] = field(default_factory=deque)  # the newest recover_steps points
    recent: deque[tuple[float, bool]] = field(default_factory=deque)  # newest (loss, high)
    detected: _Point | None = None  # where it became an incident
    rule: Literal["window", "rising"] | None = None  # which rule made it one

    def finding(self, cfg: LossSpikeConfig, recovered_at: _Point | None) -> Finding | None:
        p0, peak = self.start, self.peak
        details: dict[str, Any] = {
            "start_step": p0.step, "last_high_step": self.last_high.step,
            "steps": self.high_steps, "high_steps": self.high_steps,
            "peak_loss": peak.loss, "peak_step": peak.step, "start_loss": p0.loss,
            "baseline_median": self.med, "baseline_mad": self.mad, "threshold": self.thr,
            "back_level": self.back, "recovery_window_steps": cfg.recovery_window_steps,
            "ratio": (peak.loss / self.med) if self.med else None,
            "recovered_at_step": None if recovered_at is None else recovered_at.step,
            "detected_at_step": None if self.detected is None else self.detected.step,
            "rule": self.rule,
        }
        if p0.grad_norm is not None:
            details["grad_norm_at_start"] = p0.grad_norm
        if self.grad_norm_median is not None:
            details["grad_norm_median"] = self.grad_norm_median
        what = (f"loss {p0.loss:.4g} at step {p0.step} (peak {peak.loss:.4g} at step "
                f"{peak.step}) vs baseline median {self.med:.4g}, MAD {self.mad:.3g}, "
                f"threshold {self.thr:.4g}")
        if self.detected is not None:
            tail = "" if recovered_at is None else f"; came back at step {recovered_at.step}"
            if self.rule == "rising":
                why = (f"still rising at step {self.detected.step} (the last {cfg.rise_steps} "
                       f"steps all high, up x{cfg.rise_factor:g} or more)")
            else:
                why = (f"not back to baseline (<= {self.back:.4g}) within "
                       f"{cfg.recovery_window_steps} steps")
            msg = f"loss spike: {what}; high for {self.high_steps} steps, {why}{tail}"
            return Finding(kind=FindingKind.LOSS_SPIKE, severity=INCIDENT, message=msg,
                           step=p0.step, started_at=p0.t, details=details)
        if recovered_at is None or self.high_steps < cfg.transient_min_steps:
            return None  # still open and not yet judged, or a single outlier
        msg = (f"transient loss spike: {what}; high for {self.high_steps} steps, back at step "
               f"{recovered_at.step} by itself")
        return Finding(kind=FindingKind.LOSS_SPIKE_TRANSIENT, severity=EVENT, message=msg,
                       step=p0.step, started_at=p0.t, details=details)

    def add(self, p: _Point, cfg: LossSpikeConfig) -> _Point | None:
        """One more point; returns where the spike was back once it is over, else None."""
        self.points += 1
        high = p.loss > self.thr
        if high:
            self.high_steps += 1
            self.last_high = p
            if p.loss > self.peak.loss:
                self.peak = p
        self.recent.append((p.loss, high))
        if len(self.recent) > cfg.rise_steps:
            self.recent.popleft()
        self.tail.append(p)
        if len(self.tail) > cfg.recover_steps:
            self.tail.popleft()
        # Back from the tail's first step, or the first one after a high step in it.
        since = next((i + 1 for i in range(len(self.tail) - 1, -1, -1)
                      if self.tail[i].loss > self.thr), 0)
        if (since < len(self.tail) and len(self.tail) == cfg.recover_steps
                and median(q.loss for q in self.tail) <= self.back):
            return self.tail[since]
        if self.detected is None:
            if self._rising(cfg):
                self.detected, self.rule = p, "rising"
            elif self.high_steps >= cfg.sustain_steps:
                # The earliest step it could still turn out to be back at: where the next
                # tail starts, and after the newest high step.
                nxt = self.tail[1].step if len(self.tail) > 1 else p.step + 1
                earliest = max(nxt, self.last_high.step + 1)
                if earliest - self.start.step > cfg.recovery_window_steps:
                    self.detected, self.rule = p, "window"
        return None

    def _rising(self, cfg: LossSpikeConfig) -> bool:
        if len(self.recent) < cfg.rise_steps or not all(h for _, h in self.recent):
            return False
        xs = [x for x, _ in self.recent]
        half = len(xs) // 2
        older, newer = median(xs[:half]), median(xs[-half:])
        return newer >= cfg.rise_factor * older


class LossSpikeTracker:
    """The scan of ``detect_loss`` kept between calls (one per lineage).

    ``feed(samples)`` consumes the samples of steps after the last step fed (earlier ones are
    ignored: a step is merged from the samples of the call that first brings it) and returns
    the findings as of now: the first non-finite step ever fed, the spikes that ended within
    the last ``lookback_steps`` steps, and the open spike once it is an incident."""

    def __init__(self, cfg: LossSpikeConfig | None = None) -> None:
        self.cfg = cfg or LossSpikeConfig()
        self.last_step: int | None = None
        self._base = _Baseline(self.cfg.window_steps)
        self._grads: deque[float] = deque(maxlen=self.cfg.window_steps)
        self._spike: _Spike | None = None
        self._closed: list[Finding] = []
        self._nonfinite: Finding | None = None

    def feed(self, samples: Iterable[LossSample]) -> list[Finding]:
        new = [x for x in samples if self.last_step is None or x.step > self.last_step]
        if new:
            nf = detect_nonfinite(new) if self._nonfinite is None else None
            for p in _merge(new):
                if nf is not None and nf.step is not None and p.step >= nf.step:
                    self._set_nonfinite(nf)
                    nf = None
                self._add(p)
            if nf is not None:
                self._set_nonfinite(nf)
            self.last_step = max(x.step for x in new)
        return self.findings()

    def _set_nonfinite(self, nf: Finding) -> None:
        """Record the first non-finite step, with the start of the spike open before it (a
        loss that climbed to NaN started going wrong there)."""
        if self._spike is not None:
            start = self._spike.start
            nf = dataclasses.replace(nf, details={**nf.details, "start_step": start.step},
                                     started_at=start.t if start.t is not None
                                     else nf.started_at)
        self._nonfinite = nf

    def findings(self) -> list[Finding]:
        out = [self._nonfinite] if self._nonfinite is not None else []
        if self.last_step is not None:
            oldest = self.last_step - self.cfg.lookback_steps
            self._closed = [f for f in self._closed
                            if f.details["recovered_at_step"] >= oldest]
        out.extend(self._closed)
        if self._spike is not None:
            f = self._spike.finding(self.cfg, recovered_at=None)
            if f is not None:
                out.append(f)
        return out

    def _add(self, p: _Point) -> None:
        cfg, sp = self.cfg, self._spike
        if sp is None:
            if len(self._base) >= cfg.min_history:
                med, m, thr = self._base.stats(cfg)
                if p.loss > thr:
                    gm = median(self._grads) if self._grads else None
                    back = med + max(cfg.recover_z * MAD_TO_SIGMA * m * _MEDIAN_SE
                                     / math.sqrt(cfg.recover_steps),
                                     cfg.recover_rel * abs(med), cfg.min_abs)
                    self._spike = _Spike(start=p, med=med, mad=m, thr=thr, back=back,
                                         grad_norm_median=gm, last_high=p, peak=p,
                                         recent=deque([(p.loss, True)]), tail=deque([p]))
                    return
            self._base.add(p.loss)
            if p.grad_norm is not None:
                self._grads.append(p.grad_norm)
            return
        recovered_at = sp.add(p, cfg)
        if recovered_at is not None:
            f = sp.finding(cfg, recovered_at=recovered_at)
            if f is not None:
                self._closed.append(f)
            for q in sp.tail:  # the steps it was back at are normal again
                if q.step < recovered_at.step:
                    continue
                self._base.add(q.loss)
                if q.grad_norm is not None:
                    self._grads.append(q.grad_norm)
            self._spike = None

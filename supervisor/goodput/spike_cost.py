"""What a loss spike cost against what a rollback past it would cost, both from the run's own
figures (pure: numbers in, numbers out; no clock, no I/O).

**Progress lost.**  The reference is the run's own curve before the spike: the running
median of ``smooth_steps`` losses, made monotone (the best smoothed loss reached by each
step), and past the spike's start a power law ``L = a x step^-p`` fitted to the last
``fit_steps`` smoothed steps before it (flat when the fit does not fall).  The loss *now* is
the median of the newest ``now_steps`` losses.  It lies at the level the reference had at
step ``h``: the run is ``now - h`` steps behind where it would be without the spike, and
that is the progress lost (in seconds: x the measured step time).  A loss within
``tolerance`` standard errors of the reference now lost nothing (a one-step blip that is
gone costs 0).  A loss at or above the run's early-training loss (the reference at its
first step) erased everything since then: ``h`` is the first step and ``above_early`` is set.

Re-measured at each look, the figure follows the spike as it unfolds: a loss that comes back
and catches up shrinks it; an excess that lasts (an optimizer state the spike bent slows the
steps after it) keeps it, and ``excess`` (the loss now / the reference now - 1) says by how
much.  With ``end_step`` known, ``lost_steps_at_end`` projects a lasting excess to the run's
end along the fitted power law: ``end x (1 - (1 + excess)^(-1/p))``.

**Rollback cost.**  The steps since the checkpoint it would load (trained again) x the
measured step time, plus the measured restart time (decision to first step, from the
restart anatomy), plus the batches it skips x the step time (their data is not trained on).

``cheaper`` is ``rollback`` when its cost is below the progress lost, or whatever it costs
when the loss is above the early-training loss (``certain``: nothing is left to lose by
rolling back, and nothing says training brings it back), else ``wait``.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

# The standard error of a median of n normal values is ~1.2533 x sigma / sqrt(n); sigma
# ~ 1.4826 x MAD.
_MEDIAN_SE = 1.2533
_MAD_TO_SIGMA = 1.4826


@dataclass(frozen=True)
class SpikeCostConfig:
    smooth_steps: int = 9  # the reference curve: a running median of this many steps
    # The loss now: the median of this many newest steps (as many as the spike detector's
    # "back" judges, so a spike it calls back is measured back).
    now_steps: int = 5
    fit_steps: int = 50  # the power law is fitted to this many steps before the spike
    tolerance: float = 2.0  # standard errors of the loss now: within them, nothing lost
    # a rollback's restart when the run has had none to measure (seconds)
    default_restart_s: float = 60.0


@dataclass(frozen=True)
class SpikeCost:
    now_step: int
    loss_now: float  # median of the newest now_steps losses
    reference_now: float  # where the run's own curve would be now
    excess: float  # loss_now / reference_now - 1 (0 within the tolerance)
    equivalent_step: int  # the step whose reference loss is loss_now
    above_early: bool  # at or above the early-training loss: everything since erased
    lost_steps: int
    lost_s: float
    lost_steps_at_end: int | None  # a lasting excess projected to end_step, when known
    rollback_steps: float  # steps trained again + skipped + the restart in steps
    rollback_s: float
    checkpoint_step: int | None
    skipped_batches: int
    step_s: float
    restart_s: float
    restart_measured: bool  # False: no restart of the run to measure, the default was used
    cheaper: Literal["rollback", "wait"]
    certain: bool

    def as_details(self) -> dict[str, Any]:
        """JSON-safe (an impossible rollback's infinite cost is None)."""
        return {k: None if isinstance(v, float) and not math.isfinite(v) else v
                for k, v in asdict(self).items()}

    def summary(self) -> str:
        """One line for an incident's or event's message."""
        line = summary_of(self.as_details())
        assert line is not None  # its own details always read
        return line


def summary_of(d: Mapping[str, Any]) -> str | None:
    """The one-line statement of ``SpikeCost.as_details()`` (as stored on an incident or an
    event); None when ``d`` is not one."""
    try:
        lost, lost_s = int(d["lost_steps"]), float(d["lost_s"])
        at_end, rb, rb_s = d.get("lost_steps_at_end"), d["rollback_steps"], d["rollback_s"]
        cheaper, measured = d["cheaper"], bool(d["restart_measured"])
    except (KeyError, TypeError, ValueError):
        return None
    end = "" if at_end is None else f", {at_end} by the run's end"
    restart = "" if measured else ", restart time not measured yet"
    rollback = ("no rollback possible (no checkpoint before it)" if rb is None
                else f"a rollback {float(rb):.0f} steps ({float(rb_s):.3g} s{restart})")
    if d.get("certain"):  # the rule, not the comparison, decided: say which
        verdict = ("the loss is at or above the run's early-training loss, everything since "
                   "erased: rolling back whatever it costs")
    else:
        verdict = f"{'rolling back' if cheaper == 'rollback' else 'waiting'} is cheaper"
    return f"progress lost {lost} steps ({lost_s:.3g} s{end}) vs {rollback}: {verdict}"


def _smooth(points: Sequence[tuple[int, float]], k: int) -> list[tuple[int, float]]:
    """Trailing running median of ``k`` (fewer at the start)."""
    out = []
    for i, (s, _) in enumerate(points):
        out.append((s, statistics.median(x for _, x in points[max(0, i - k + 1):i + 1])))
    return out


def _power_fit(points: Sequence[tuple[int, float]]) -> tuple[float, float] | None:
    """(log a, -p) of ``log L = log a - p log(step + 1)``; None without a falling fit."""
    xs = [math.log(s + 1) for s, x in points if x > 0]
    ys = [math.log(x) for _, x in points if x > 0]
    if len(xs) < 3 or max(xs) == min(xs):
        return None
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    if slope >= 0:
        return None
    return my - slope * mx, slope


@dataclass(frozen=True)
class ProgressLost:
    """What the spike cost so far, from the run's own curve (see the module docstring)."""

    start_step: int
    now_step: int
    loss_now: float
    reference_now: float
    excess: float
    equivalent_step: int
    above_early: bool
    lost_steps: int
    lost_s: float
    lost_steps_at_end: int | None
    step_s: float

    def as_details(self) -> dict[str, Any]:
        return asdict(self)


def progress_lost(history: Sequence[tuple[int, float]], *, start: int, step_s: float,
                  end_step: int | None = None, cfg: SpikeCostConfig | None = None
                  ) -> ProgressLost | None:
    """The progress the spike that started at ``start`` erased, as of the newest step of
    ``history`` (``[(step, loss)]`` of the current lineage, any order; non-finite losses
    are left out).  None without ``smooth_steps`` steps before the spike or one after it."""
    cfg = cfg or SpikeCostConfig()
    pts = sorted((int(s), float(x)) for s, x in history if math.isfinite(x))
    before = [p for p in pts if p[0] < start]
    after = [p for p in pts if p[0] >= start]
    if len(before) < cfg.smooth_steps or not after:
        return None
    now = after[-1][0]
    loss_now = statistics.median(x for _, x in pts[-cfg.now_steps:])
    sm = _smooth(before, cfg.smooth_steps)
    env_steps, env = [], []
    best = math.inf
    for s, x in sm:
        best = min(best, x)
        env_steps.append(s)
        env.append(best)
    fit = _power_fit(sm[-cfg.fit_steps:])
    last_ref = env[-1]

    def reference(step: int) -> float:
        if step < start:
            i = bisect.bisect_right(env_steps, step) - 1
            return env[max(0, i)]
        return last_ref if fit is None else min(last_ref, math.exp(fit[0] + fit[1]
                                                                   * math.log(step + 1)))

    # The noise of a median of smooth_steps values: the spread of the losses before the
    # spike around their running median (not around one median: the curve falls).
    resid = [x - y for (_, x), (_, y) in zip(before[-cfg.fit_steps:], sm[-cfg.fit_steps:],
                                             strict=True)]
    mad = statistics.median(abs(r) for r in resid)
    tol = cfg.tolerance * _MEDIAN_SE * _MAD_TO_SIGMA * mad / math.sqrt(cfg.now_steps)
    ref_now = reference(now)
    if fit is not None and now > start:
        # The fit's own error past its data, measured on the run: fitted to the older half of
        # its window, how far off is it on the newer half (a curve that flattens falls slower
        # than a power law says)?  Scaled to how far past the spike ``now`` is.
        window = sm[-cfg.fit_steps:]
        half = len(window) // 2
        early = _power_fit(window[:half])
        if early is None:
            err = 0.0
        else:
            err = statistics.median(
                abs(math.exp(early[0] + early[1] * math.log(s + 1)) / x - 1)
                for s, x in window[half:])
        span = max(1, window[-1][0] - window[half][0] + 1)
        tol += ref_now * err * max(1.0, (now - start) / span)
    above_early = loss_now >= env[0]
    if above_early:
        h = env_steps[0]
    elif loss_now <= ref_now + tol:
        h = now
    elif loss_now >= last_ref:
        # The first step of the monotone history at or below the loss now.
        i = next(i for i, x in enumerate(env) if x <= loss_now)
        h = env_steps[i]
    else:  # between the spike's start and now, on the fitted curve
        assert fit is not None
        h = int(min(now, max(start, math.exp((math.log(loss_now) - fit[0]) / fit[1]) - 1)))
    lost = max(0, now - h)
    excess = 0.0 if h == now else loss_now / ref_now - 1
    at_end = None
    if end_step is not None:
        if above_early:
            at_end = max(lost, end_step - h)
        elif lost == 0 or fit is None:
            at_end = lost  # nothing lost, or a flat curve: no slope to project along
        else:
            at_end = max(lost, int(end_step * (1 - (1 + excess) ** (1 / fit[1]))))
    return ProgressLost(start_step=start, now_step=now, loss_now=loss_now,
                        reference_now=ref_now, excess=excess, equivalent_step=h,
                        above_early=above_early, lost_steps=lost, lost_s=lost * step_s,
                        lost_steps_at_end=at_end, step_s=step_s)


def weigh(p: ProgressLost, *, checkpoint_step: int | None, skipped_batches: int = 0,
          restart_s: float | None = None, cfg: SpikeCostConfig | None = None) -> SpikeCost:
    """The rollback's cost (to ``checkpoint_step``, skipping ``skipped_batches``, with the
    run's measured restart time, or the default when it has none) against ``p``."""
    cfg = cfg or SpikeCostConfig()
    step_s = p.step_s
    measured = restart_s is not None
    r_s = restart_s if restart_s is not None else cfg.default_restart_s
    if checkpoint_step is None or step_s <= 0:
        rb_steps = math.inf
    else:
        rb_steps = (p.now_step - checkpoint_step) + skipped_batches + r_s / step_s
    rb_s = rb_steps * step_s if math.isfinite(rb_steps) else math.inf
    lost_for_choice = p.lost_steps_at_end if p.lost_steps_at_end is not None else p.lost_steps
    # Above the early-training loss the run has nothing left to lose by rolling back, and
    # no sign that training brings it back: a rollback whatever it costs.
    certain = p.above_early and checkpoint_step is not None
    cheaper: Literal["rollback", "wait"] = (
        "rollback" if certain or rb_steps < lost_for_choice else "wait")
    return SpikeCost(
        now_step=p.now_step, loss_now=p.loss_now, reference_now=p.reference_now,
        excess=p.excess, equivalent_step=p.equivalent_step, above_early=p.above_early,
        lost_steps=p.lost_steps, lost_s=p.lost_s, lost_steps_at_end=p.lost_steps_at_end,
        rollback_steps=rb_steps, rollback_s=rb_s, checkpoint_step=checkpoint_step,
        skipped_batches=skipped_batches, step_s=step_s, restart_s=r_s,
        restart_measured=measured, cheaper=cheaper, certain=certain)


def spike_cost(history: Sequence[tuple[int, float]], *, start: int, step_s: float,
               checkpoint_step: int | None, skipped_batches: int = 0,
               restart_s: float | None = None, end_step: int | None = None,
               cfg: SpikeCostConfig | None = None) -> SpikeCost | None:
    """Both costs at once: ``weigh(progress_lost(...), ...)``."""
    p = progress_lost(history, start=start, step_s=step_s, end_step=end_step, cfg=cfg)
    if p is None:
        return None
    return weigh(p, checkpoint_step=checkpoint_step, skipped_batches=skipped_batches,
                 restart_s=restart_s, cfg=cfg)

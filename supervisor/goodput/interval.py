"""Checkpoint-interval advice from the failure rate, the save stall and the restart cost.

Models (all times in seconds):

* Young/Daly first order: the interval that minimises the time lost to saves plus the work
  redone after failures is ``sqrt(2 * w * M)``, with ``w`` the time training stalls per save
  and ``M`` the job's mean time between failures (Young 1974, "A first order approximation to
  the optimum checkpoint interval"; Daly 2006 gives the higher-order terms, negligible while
  ``w << M``).
* Meta's expected ETTR (Kokolis et al. 2024, "Revisiting Reliability in Large-Scale Machine
  Learning Research Clusters", arXiv 2410.21680)::

      E[ETTR] ~ (1 - N * r_f * (u0 + dt / 2)) / (1 + w / dt)

  with ``N`` nodes, ``r_f`` failures per node-second, ``u0`` the restart overhead (fault to
  training again: detection plus restart), ``dt`` the checkpoint interval and ``w`` the stall
  per save.  Each failure costs ``u0`` plus on average half an interval of redone work; each
  interval of training costs ``w`` of saving.  Writing ``M = 1 / (N r_f)``, its maximum over
  ``dt`` is at ``dt* = sqrt(w^2 + 2 w (M - u0)) - w`` (set the derivative to zero: a
  quadratic in ``dt``), which tends to Young's ``sqrt(2 w M)`` when ``u0, w << M``.  The
  recommended interval is ``dt*``; when ``M <= u0`` no interval helps (failures come faster
  than the run recovers) and none is recommended.

The failure rate is the run's own (interrupting incidents per node-time) once it has seen
``min_failures``; before that a prior rate is used when one is given (e.g. Meta's 6.5
failures per 1,000 node-days, ``META_RSC_PER_NODE_DAY``), else no interval is recommended
and the advice says why, with the ETTR the saves alone cost at the current interval.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

from trainwarden.agent.core.bounds import bound, bounded, check
from trainwarden.supervisor.goodput.units import duration

# Where the failure rate comes from: the run's own failures, the prior, or neither.
RateSource = Literal["observed", "prior", "none"]

DAY_S = 86_400.0
# Published failure rates per node-day (8-GPU nodes).
META_RSC_PER_NODE_DAY = 6.5 / 1000  # Kokolis et al. 2024, RSC-1
# Llama 3 405B pre-training: 419 unexpected interruptions in 54 days on 16,384 GPUs (2,048
# 8-GPU nodes): Dubey et al. 2024, "The Llama 3 Herd of Models", section 3.3.4.
LLAMA3_PER_NODE_DAY = 419 / 54 / 2048


def young_interval(save_stall_s: float, mtbf_s: float) -> float:
    """Young/Daly first-order optimum: sqrt(2 w M)."""
    return math.sqrt(2.0 * save_stall_s * mtbf_s)


def expected_ettr(*, nodes: int, rate_per_node_s: float, restart_s: float, interval_s: float,
                  save_stall_s: float) -> float:
    """Meta's E[ETTR] (can be negative when failures outpace recovery; callers clamp)."""
    if interval_s <= 0:
        raise ValueError("expected_ettr: interval_s must be > 0")
    lam = nodes * rate_per_node_s
    return (1.0 - lam * (restart_s + interval_s / 2.0)) / (1.0 + save_stall_s / interval_s)


def optimal_interval(*, mtbf_s: float, restart_s: float, save_stall_s: float) -> float | None:
    """The interval maximising Meta's E[ETTR]; None when ``mtbf_s <= restart_s`` (no
    interval gives positive ETTR) or the stall is 0 (the model then prefers saving always)."""
    if not math.isfinite(mtbf_s) or mtbf_s <= restart_s or save_stall_s <= 0:
        return None
    w = save_stall_s
    return math.sqrt(w * w + 2.0 * w * (mtbf_s - restart_s)) - w


@dataclass(frozen=True)
class IntervalInputs:
    """What the advice is computed from.

    ``failures``: interrupting incidents (crash, hang, node lost, collective timeout: those
    that restarted the run) seen in ``observed_s`` of wall time on ``nodes`` nodes;
    ``save_stall_s``: mean time training stalled per save; ``restart_s``: mean fault-to-
    training-again time (detection plus restart) of the run's restarts; ``interval_s``: the
    current mean time between saves (None before two saves)."""

    nodes: int = field(metadata=bound(ge=1))
    failures: int = field(metadata=bound(ge=0))
    observed_s: float = field(metadata=bound(ge=0, finite=True))
    save_stall_s: float = field(metadata=bound(ge=0, finite=True))
    restart_s: float = field(metadata=bound(ge=0, finite=True))
    interval_s: float | None = bounded(None, gt=0)
    prior_per_node_day: float | None = bounded(
        None, gt=0, hint=f"or unset; e.g. {META_RSC_PER_NODE_DAY:g}")
    min_failures: int = bounded(1, ge=1)

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class Advice:
    rate_source: RateSource
    rate_per_node_day: float | None
    failures_per_day: float | None  # of the whole job
    mtbf_s: float | None  # of the whole job
    young_s: float | None
    recommended_s: float | None
    current_s: float | None
    ettr_current: float | None  # Meta's model at the current interval, clamped to [0, 1]
    ettr_recommended: float | None
    gain: float | None  # ettr_recommended - ettr_current
    note: str
    inputs: IntervalInputs

    def as_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["inputs"] = asdict(self.inputs)
        return d


def _clamp(x: float) -> float:
    return min(1.0, max(0.0, x))


def advise(inp: IntervalInputs) -> Advice:
    """The recommended interval and what the current one costs against it."""
    source: RateSource
    if inp.failures >= inp.min_failures and inp.observed_s > 0:
        source, per_node_s = "observed", inp.failures / (inp.nodes * inp.observed_s)
    elif inp.prior_per_node_day is not None:
        source, per_node_s = "prior", inp.prior_per_node_day / DAY_S
    else:
        source, per_node_s = "none", 0.0
    cur = inp.interval_s
    if source == "none":
        saves_only = _clamp(1.0 / (1.0 + inp.save_stall_s / cur)) if cur else None
        seen = inp.observed_s / 3600.0
        return Advice(
            rate_source=source, rate_per_node_day=None, failures_per_day=None, mtbf_s=None,
            young_s=None, recommended_s=None, current_s=cur, ettr_current=saves_only,
            ettr_recommended=None, gain=None, inputs=inp,
            note=(f"no failures observed yet ({inp.failures} in {seen:.1f} h on {inp.nodes} "
                  f"node(s)): the interval cannot be derived from this run's failure rate; "
                  "the ETTR shown is what the save stalls alone cost (pass a prior rate for "
                  "advice before the first failure)"))
    lam = inp.nodes * per_node_s
    mtbf = 1.0 / lam
    young = young_interval(inp.save_stall_s, mtbf) if inp.save_stall_s > 0 else None
    rec = optimal_interval(mtbf_s=mtbf, restart_s=inp.restart_s, save_stall_s=inp.save_stall_s)

    def ettr(dt: float | None) -> float | None:
        if dt is None:
            return None
        return _clamp(expected_ettr(nodes=inp.nodes, rate_per_node_s=per_node_s,
                                    restart_s=inp.restart_s, interval_s=dt,
                                    save_stall_s=inp.save_stall_s))

    e_cur, e_rec = ettr(cur), ettr(rec)
    if rec is None and mtbf <= inp.restart_s:
        note = (f"failures every {mtbf:.0f} s on average, restarts take {inp.restart_s:.0f} s: "
                "the run cannot make progress at this rate; no interval helps, shorten the "
                "restart first")
    elif rec is None:
        note = ("no save stall measured: saving costs training nothing, so save as often as "
                "storage allows")
    else:
        note = (f"{source} failure rate {per_node_s * DAY_S * 1000:.2f} per 1,000 node-days: "
                f"one failure every {duration(mtbf)} on {inp.nodes} node(s); "
                f"save every {duration(rec)}")
    return Advice(rate_source=source, rate_per_node_day=per_node_s * DAY_S,
                  failures_per_day=lam * DAY_S, mtbf_s=mtbf, young_s=young, recommended_s=rec,
                  current_s=cur, ettr_current=e_cur, ettr_recommended=e_rec,
                  gain=(e_rec - e_cur) if e_rec is not None and e_cur is not None else None,
                  note=note, inputs=inp)

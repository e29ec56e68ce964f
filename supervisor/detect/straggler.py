"""Straggler: the rank that makes every other rank wait, named.

In synchronous data parallelism every rank's wall step time is the same (the fast ranks wait
in the all-reduce for the slow one), so wall step time cannot tell which rank is slow.  The time
a rank spends *before* the first blocking collective can: ``data_s + compute_s`` (waiting for
its batch, forward and backward).

Peer signal (as in NVIDIA's resiliency extension): each rank's pre-collective time is
summarised by its median over the last ``window_steps`` steps, and its score is
``median of the other ranks' medians / this rank's median``: 1.0 is typical, 0.67 is a rank
1.5x slower.  A rank is flagged when its score is below ``threshold`` with at least
``min_steps`` measurements in the window.  Medians over the window make the flag need a
sustained slowdown (more than half the window), so a single slow step (a page fault, a GC
pause, a checkpoint) moves nothing, and they average the per-step noise of *both* sides down
before the ratio is taken.  The median of the *other* ranks (rather than of all ranks, self
included) keeps a 2- or 3-rank job honest: with two ranks the slow one would otherwise pull
its own reference half-way up.  A rank must also be at least ``min_excess_s`` slower than its
peers (medians over the window).  Windows are step ranges: the newest ``window_steps`` steps.

One statistic: ``straggler_scores`` is the score and the rule above on the newest window, and
it is what everything else uses: the detector (below), ``/metrics``
(``trainwarden_rank_straggler_score`` and ``trainwarden_rank_straggler_slow``), the
dashboard's ranks table and chart, the API's ``/runs/{run}/ranks`` and, through the exported
``slow``, the ``TrainwardenStraggler`` alert: its threshold is this configuration's.

Hold: the same score over the longer ``hold_steps`` window also flags.  The short window
flags early; the long one, less noisy, keeps the flag up while the straggler stays slow (with
few ranks and noisy steps a 20-step median can wander back over the threshold now and then),
and lets it go about ``hold_steps / 2`` steps after the rank recovers.

Own-history signal: ``baseline / recent`` of the rank's own pre-collective time (``recent``:
its median over the last ``window_steps``; ``baseline``: one the caller passes, e.g.
``rank_baselines`` over an early window of the attempt after warm-up, computed once, or else
the median of the older steps of the window, which fades once the slowdown fills the window).
It is reported in ``details`` of every flagged rank and is the only signal when a single rank
reports (nobody to compare with).  With peers it never flags by itself: most ranks slowing
down at once is throughput decay, not a straggler.

Per-step scores (the same ratio, step by step) serve only to place the onset of the slow
stretch (``Finding.step``); they are computed for flagged ranks only.

Why the defaults: ``threshold = 0.75`` is NVIDIA's; ``window_steps = 20`` flags a 1.5x
straggler after about 11 slow steps (the median turns once more than half the window is slow)
while +-20% per-step noise on every rank leaves the median score near 1.0; ``min_steps = 10``
keeps a fresh attempt from being judged on a handful of steps, after its first
``warmup_steps = 10`` (never judged: cold starts); ``hold_steps = 60`` medians are
steady enough that a 1.5x straggler does not drop out.  Cost: two medians per rank per call.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.supervisor.detect._stats import median, median_excluding
from trainwarden.supervisor.detect.findings import INCIDENT, Finding, FindingKind

# step -> rank -> seconds before the first blocking collective (data_s + compute_s)
PreCollectiveTable = Mapping[int, Mapping[int, float]]


@dataclass(frozen=True)
class StragglerConfig:
    SECTION: ClassVar[str] = "straggler"

    # flag when the sustained score is below this
    threshold: float = bounded(0.75, gt=0, lt=1, hint="try 0.75")
    window_steps: int = bounded(20, ge=1)  # the sustained window (newest steps of the table)
    hold_steps: int = bounded(60, ge=0)  # the longer window that keeps a flag up (0: none)
    min_steps: int = bounded(10, ge=1)  # scores a rank needs in the window to be judged
    # baseline / recent below this: slower than its own past
    self_threshold: float = bounded(0.75, gt=0, lt=1, hint="try 0.75")
    min_baseline_steps: int = bounded(10, ge=1)  # older steps needed for an own-history baseline
    # this many consecutive normal steps end the slow stretch (onset search)
    onset_gap: int = bounded(3, ge=1)
    # A rank must also be slower than its peers (or, alone, than its own past) by this many
    # seconds (median over the window): with steps of a few milliseconds, scheduler noise
    # alone makes 2x ratios.
    min_excess_s: float = bounded(0.01, ge=0)
    # The first steps of each attempt are never judged: every rank's first steps after a
    # start (a fresh one, a restart, a node that just joined) run cold (caches, allocator,
    # the data pipeline filling), and a new node's more so than the others'.
    warmup_steps: int = bounded(10, ge=0, hint="0: judge from the first step")

    def __post_init__(self) -> None:
        check(self)
        cross_check(self.hold_steps == 0 or self.hold_steps >= self.window_steps, self,
                    "hold_steps", f"0 or >= window_steps = {self.window_steps}",
                    got=self.hold_steps, hint="try 3 x window_steps")
        cross_check(self.min_steps <= self.window_steps, self, "min_steps",
                    f"<= window_steps = {self.window_steps}", got=self.min_steps)


def pre_collective_table(rows: Iterable[Mapping[str, Any]]) -> dict[int, dict[int, float]]:
    """Build the detector's input from per-rank step rows (dicts with ``step``, ``rank``,
    ``data_s``, ``compute_s``, as the store returns them); see ``add_pre_collective``."""
    out: dict[int, dict[int, float]] = {}
    for row in rows:
        add_pre_collective(out, int(row["step"]), int(row["rank"]), row.get("data_s"),
                           row.get("compute_s"))
    return out


def add_pre_collective(table: dict[int, dict[int, float]], step: int, rank: int,
                       data_s: float | None, compute_s: float | None) -> None:
    """Put one rank's step into ``table``.  A missing part counts as 0; a row with neither,
    or a non-finite or non-positive total, is left out."""
    if data_s is None and compute_s is None:
        return
    v = float(data_s or 0.0) + float(compute_s or 0.0)
    if math.isfinite(v) and v > 0:
        table.setdefault(step, {})[rank] = v


@dataclass(frozen=True)
class RankScore:
    """One rank's straggler score over a window: the number the detector judges, ``/metrics``
    exports, the dashboard and the API show and the ``TrainwardenStraggler`` alert reads."""

    rank: int
    score: float  # median of the other ranks' medians / this rank's median
    rank_s: float  # this rank's median pre-collective seconds over the window
    peers_s: float  # the median of the other ranks' medians
    steps: int  # this rank's measurements in the window
    slow: bool  # the detector's rule on this window: score < threshold and excess >= min

    @property
    def excess_s(self) -> float:
        """Seconds this rank is slower than its peers (medians over the window)."""
        return self.rank_s - self.peers_s


def window_of(steps: Sequence[int], n: int) -> list[int]:
    """The steps of the newest ``n``-step range: ``(newest - n, newest]`` (a gap in the
    reports shortens the window rather than reaching further back)."""
    return [s for s in steps if s > steps[-1] - n] if steps else []


def straggler_scores(table: PreCollectiveTable, cfg: StragglerConfig | None = None
                     ) -> dict[int, RankScore]:
    """Every rank's score over the newest ``cfg.window_steps`` steps of ``table`` (give it
    the steps every rank has delivered), for the ranks with at least ``cfg.min_steps``
    measurements there; empty with fewer than two such ranks (no peers to compare with)."""
    cfg = cfg or StragglerConfig()
    steps = window_of(sorted(table), cfg.window_steps)
    return {r: _rank_score(r, score, peers, mine, n, cfg)
            for r, (score, peers, mine, n) in _peer_scores(table, steps, cfg.min_steps).items()}


def _rank_score(r: int, score: float, peers_s: float, rank_s: float, n: int,
                cfg: StragglerConfig) -> RankScore:
    return RankScore(rank=r, score=score, rank_s=rank_s, peers_s=peers_s, steps=n,
                     slow=score < cfg.threshold and rank_s - peers_s >= cfg.min_excess_s)


def rank_baselines(table: PreCollectiveTable, min_steps: int = 1) -> dict[int, float]:
    """Each rank's median pre-collective time over the table (for an explicit baseline: build
    it once from an early window of the attempt, after warm-up)."""
    per: dict[int, list[float]] = {}
    for row in table.values():
        for r, v in row.items():
            if _ok(v):
                per.setdefault(r, []).append(v)
    return {r: median(vs) for r, vs in per.items() if len(vs) >= min_steps}


def detect_stragglers(table: PreCollectiveTable, *, cfg: StragglerConfig | None = None,
                      baseline: Mapping[int, float] | None = None,
                      nodes: Mapping[int, str] | None = None,
                      flagged_ranks: Collection[int] = ()) -> list[Finding]:
    """One ``straggler`` incident per rank that is slow in a sustained way.

    ``table``: step -> rank -> pre-collective seconds (``pre_collective_table``), covering at
    least the newest ``hold_steps`` steps; older steps help place the onset and, without
    ``baseline``, give the own-history baseline (the newest 100 steps is a good window).
    ``baseline``: rank -> reference pre-collective seconds (optional, see ``rank_baselines``).
    ``nodes``: rank -> node name, to name the node.  ``flagged_ranks``: ranks whose straggler
    episode is still open; for them the longer ``hold_steps`` window keeps the flag up (a new
    flag needs the short window).  Cost: a few medians per rank, plus one sort per step when
    some rank is flagged.
    """
    cfg = cfg or StragglerConfig()
    nodes = nodes or {}
    steps = sorted(table)
    if not steps:
        return []
    recent_steps = window_of(steps, cfg.window_steps)
    older_steps = steps[: len(steps) - len(recent_steps)]
    short = straggler_scores(table, cfg)
    ranks = {r for s in recent_steps for r, v in table[s].items() if _ok(v)}
    out: list[Finding] = []
    if len(ranks) >= 2:
        if not flagged_ranks and not any(v.slow for v in short.values()):
            return []  # nobody slow, no episode to hold: the longer window cannot change that
        hold_steps = (window_of(steps, cfg.hold_steps)
                      if cfg.hold_steps > cfg.window_steps else [])
        held = {r: v[0] for r, v in _peer_scores(table, hold_steps, cfg.min_steps).items()
                } if hold_steps else {}
        open_ranks = set(flagged_ranks)
        # Slow on the window; or, for an episode already open, still below the threshold on
        # the longer hold window (and slower by the minimum on this one).
        flagged = [r for r, v in sorted(short.items())
                   if v.slow or (r in open_ranks and held.get(r, math.inf) < cfg.threshold
                                 and v.excess_s >= cfg.min_excess_s)]
        per_step = _step_scores(table, steps, flagged) if flagged else {}
        for r in flagged:
            v = short[r]
            hold = held.get(r, math.inf)
            own = _own_history(table, r, recent_steps, older_steps, baseline, cfg)
            extra = {"window_score": round(v.score, 4),
                     "hold_score": None if math.isinf(hold) else round(hold, 4)}
            out.append(_finding(r, nodes.get(r), "peers", min(v.score, hold), cfg.threshold,
                                per_step[r], v.peers_s, own, table, recent_steps, cfg, extra))
        return out
    for r in sorted(ranks):  # a single rank: only its own history can tell
        own = _own_history(table, r, recent_steps, older_steps, baseline, cfg)
        if (own is None or own["self_score"] >= cfg.self_threshold
                or own["recent_s"] - own["baseline_s"] < cfg.min_excess_s):
            continue
        series = [(s, own["baseline_s"] / table[s][r]) for s in steps if _ok(table[s].get(r))]
        out.append(_finding(r, nodes.get(r), "self", own["self_score"], cfg.self_threshold,
                            series, None, own, table, recent_steps, cfg, {}))
    return out


def _peer_scores(table: PreCollectiveTable, steps: list[int], min_steps: int
                 ) -> dict[int, tuple[float, float, float, int]]:
    """rank -> (median of the other ranks' medians / its median over ``steps``, that peer
    median, its median, its number of values), for ranks with at least ``min_steps`` values;
    empty with fewer than two."""
    per: dict[int, list[float]] = {}
    for s in steps:
        for r, v in table[s].items():
            if _ok(v):
                per.setdefault(r, []).append(v)
    items = sorted((median(vs), r) for r, vs in per.items() if len(vs) >= min_steps)
    if len(items) < 2:
        return {}
    vals = [m for m, _ in items]
    out = {}
    for i, (m, r) in enumerate(items):
        peers = median_excluding(vals, i)
        out[r] = (peers / m, peers, m, len(per[r]))
    return out


def _ok(v: float | None) -> bool:
    return v is not None and math.isfinite(v) and v > 0


def _step_scores(table: PreCollectiveTable, steps: list[int], ranks: list[int]
                 ) -> dict[int, list[tuple[int, float]]]:
    """rank -> [(step, median of the other ranks at that step / this rank)] for the given
    ranks, at the steps they reported (one sort per step, whatever the number of ranks)."""
    out: dict[int, list[tuple[int, float]]] = {r: [] for r in ranks}
    for s in steps:
        row = table[s]
        vals = sorted(v for v in row.values() if _ok(v))
        if len(vals) < 2:
            continue
        for r in ranks:
            v = row.get(r)
            if v is not None and _ok(v):
                # Any index holding this value will do: removing it leaves the same multiset.
                out[r].append((s, median_excluding(vals, bisect.bisect_left(vals, v)) / v))
    return out


def _own_history(table: PreCollectiveTable, r: int, recent_steps: list[int],
                 older_steps: list[int], baseline: Mapping[int, float] | None,
                 cfg: StragglerConfig) -> dict[str, Any] | None:
    recent = [table[s][r] for s in recent_steps if _ok(table[s].get(r))]
    if len(recent) < cfg.min_steps:
        return None
    base: float | None = None
    source = "given"
    if baseline is not None and _ok(baseline.get(r)):
        base = baseline[r]
    else:
        older = [table[s][r] for s in older_steps if _ok(table[s].get(r))]
        if len(older) >= cfg.min_baseline_steps:
            base, source = median(older), "window"
    if base is None:
        return None
    rec = median(recent)
    return {"baseline_s": base, "recent_s": rec, "self_score": base / rec,
            "baseline_source": source}


def _onset(series: list[tuple[int, float]], thr: float, gap: int) -> int | None:
    """First step of the trailing slow stretch: walking back from the newest step, the stretch
    ends at ``gap`` consecutive normal scores."""
    onset: int | None = None
    normal_run = 0
    for s, x in reversed(series):
        if x < thr:
            onset, normal_run = s, 0
        else:
            normal_run += 1
            if normal_run >= gap and onset is not None:
                break
    return onset


def _finding(r: int, node: str | None, signal: str, score: float, thr: float,
             series: list[tuple[int, float]], peers_s: float | None,
             own: dict[str, Any] | None, table: PreCollectiveTable, recent_steps: list[int],
             cfg: StragglerConfig, extra: dict[str, Any]) -> Finding:
    onset = _onset(series, thr, cfg.onset_gap)
    mine = median(table[s][r] for s in recent_steps if _ok(table[s].get(r)))
    recent = set(recent_steps)
    details: dict[str, Any] = {
        "signal": signal, "score": round(score, 4), "threshold": thr,
        "window": [recent_steps[0], recent_steps[-1]], "flagged_at_step": recent_steps[-1],
        "rank_pre_collective_s": round(mine, 6),
        "low_steps": sum(1 for s, x in series if s in recent and x < thr),
    }
    details.update(extra)
    if peers_s is not None:
        details["peers_pre_collective_s"] = round(peers_s, 6)
    if own is not None:
        details.update({k: (round(v, 6) if isinstance(v, float) else v) for k, v in own.items()})
    where = f"rank {r}" + (f" on {node}" if node else "")
    span = f"steps {recent_steps[0]}-{recent_steps[-1]}"
    since = f"slow since step {onset}" if onset is not None else "onset not found"
    if peers_s is not None:
        msg = (f"straggler: {where} is {1.0 / score:.2f}x slower than its peers before the "
               f"collective (score {score:.2f} < {thr}: median {mine * 1e3:.1f} ms vs "
               f"{peers_s * 1e3:.1f} ms over {span}); {since}")
    else:
        assert own is not None
        msg = (f"straggler: {where} (the only rank) is {1.0 / score:.2f}x slower than its own "
               f"baseline ({own['recent_s'] * 1e3:.1f} ms vs {own['baseline_s'] * 1e3:.1f} ms "
               f"before the collective over {span}); {since}")
    return Finding(kind=FindingKind.STRAGGLER, severity=INCIDENT, message=msg, step=onset, rank=r,
                   node=node, details=details)


def after_warmup(table: Mapping[int, dict[int, float]], first_step: int | None,
                 cfg: StragglerConfig) -> dict[int, dict[int, float]]:
    """The table without the attempt's warm-up steps (its first ``warmup_steps``, counted
    from ``first_step``, the attempt's first step; None: none known, nothing dropped)."""
    if first_step is None or not cfg.warmup_steps:
        return dict(table)
    return {s: row for s, row in table.items() if s >= first_step + cfg.warmup_steps}

"""Straggler detector: the slow rank named from pre-collective time, and quiet on clean runs."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest

from trainwarden.supervisor.detect.findings import Finding
from trainwarden.supervisor.detect.straggler import (
    StragglerConfig,
    detect_stragglers,
    pre_collective_table,
    rank_baselines,
    straggler_scores,
)

Table = dict[int, dict[int, float]]
LOOKBACK = 100  # steps the evaluator passes on each call


def make_table(ranks: int, steps: int, seed: int, noise: float = 0.2,
               factor: Callable[[int, int], float] = lambda r, s: 1.0) -> Table:
    """step -> rank -> data_s + compute_s: 100 ms x uniform noise x factor(rank, step)."""
    rng = random.Random(seed)
    return {s: {r: 0.1 * rng.uniform(1 - noise, 1 + noise) * factor(r, s) for r in range(ranks)}
            for s in range(steps)}


def slide(table: Table, cfg: StragglerConfig | None = None, **kw: Any
          ) -> list[tuple[int, Finding]]:
    """Call the detector as the evaluator would, once per new step: (newest step, finding).

    Like the evaluator, it passes the ranks whose episode is open (flagged and not yet
    cleared) as ``flagged_ranks``, so the hold window keeps their flag up."""
    out: list[tuple[int, Finding]] = []
    open_ranks: set[int] = set()
    for s in sorted(table):
        win = {q: table[q] for q in range(max(0, s - LOOKBACK + 1), s + 1)}
        found = detect_stragglers(win, cfg=cfg, flagged_ranks=open_ranks, **kw)
        open_ranks = {f.rank for f in found if f.rank is not None}
        out.extend((s, f) for f in found)
    return out


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ranks", [2, 8, 32])
def test_a_rank_made_1_5x_slower_is_named_within_50_steps(seed: int, ranks: int) -> None:
    slow_rank, slow_from = seed % ranks, 150
    table = make_table(ranks, 300, seed,
                       factor=lambda r, s: 1.5 if r == slow_rank and s >= slow_from else 1.0)
    nodes = {r: f"node{r // 4}" for r in range(ranks)}
    hits = slide(table, nodes=nodes)
    assert hits, "the straggler was never flagged"
    assert {f.rank for _, f in hits} == {slow_rank}  # no other rank, ever
    first_step, f = hits[0]
    assert slow_from <= first_step < slow_from + 50
    assert (f.kind, f.severity, f.node) == ("straggler", "incident", nodes[slow_rank])
    assert f.details["signal"] == "peers" and f.details["score"] < 0.75
    assert f.step is not None and abs(f.step - slow_from) <= 3  # the onset
    assert f"rank {slow_rank} on {nodes[slow_rank]}" in f.message
    # It stays flagged while the rank stays slow: at every step once the hold window (60
    # steps) is mostly slow; before that, near the threshold, a flag may flicker (the
    # evaluator dedupes on the rank).
    flagged = {s for s, _ in hits}
    assert set(range(slow_from + 50, 300)) <= flagged


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("ranks", [2, 8, 32])
def test_no_false_positive_with_20pct_jitter_on_every_rank(seed: int, ranks: int) -> None:
    assert slide(make_table(ranks, 400, seed, noise=0.2)) == []


@pytest.mark.parametrize("seed", range(5))
def test_no_false_positive_with_slow_2pct_drift(seed: int) -> None:
    # Each rank drifts slowly, up or down by 2% over the run (thermal, fragmentation).
    drift = {r: random.Random(seed + 100).choice([-0.02, 0.02]) for r in range(8)}
    table = make_table(8, 400, seed, noise=0.1, factor=lambda r, s: 1 + drift[r] * s / 400)
    assert slide(table) == []


@pytest.mark.parametrize("seed", range(5))
def test_single_outlier_steps_are_ignored(seed: int) -> None:
    # Every 30 steps some rank has one step 5x slower (GC pause, page fault, a checkpoint).
    table = make_table(8, 300, seed, factor=lambda r, s: 5.0 if s % 30 == 0 and
                       r == (s // 30) % 8 else 1.0)
    assert slide(table) == []


def test_a_single_rank_is_judged_against_its_own_history() -> None:
    table = make_table(1, 200, 3, factor=lambda r, s: 1.5 if s >= 120 else 1.0)
    hits = slide(table)
    assert hits
    first_step, f = hits[0]
    assert 120 <= first_step < 170
    assert f.rank == 0 and f.details["signal"] == "self"
    assert f.details["self_score"] < 0.75 and f.details["baseline_source"] == "window"
    # The same single rank without a slowdown: quiet.
    assert slide(make_table(1, 200, 3)) == []
    # The same 1.5x on sub-millisecond steps (0.1 ms -> 0.15 ms): scheduler noise, not a
    # straggler; below min_excess_s, as with peers.
    tiny = {s: {0: v[0] / 1000} for s, v in table.items()}
    assert slide(tiny) == []


def test_own_history_is_reported_and_an_explicit_baseline_is_used() -> None:
    table = make_table(8, 60, 11, factor=lambda r, s: 1.5 if r == 6 else 1.0)
    base = rank_baselines(make_table(8, 50, 12))  # an early window before the slowdown
    [f] = detect_stragglers(table, baseline=base)
    assert f.rank == 6
    assert f.details["baseline_source"] == "given"
    assert f.details["self_score"] == pytest.approx(1 / 1.5, abs=0.08)
    assert f.node is None


def test_most_ranks_slowing_together_is_not_a_straggler() -> None:
    # A cluster-wide slowdown is throughput decay: peers agree, nobody is named.
    table = make_table(8, 200, 4, factor=lambda r, s: 1.5 if s >= 100 else 1.0)
    assert slide(table) == []


def test_the_flag_is_released_after_the_rank_recovers() -> None:
    table = make_table(8, 400, 6, factor=lambda r, s: 1.5 if r == 2 and 100 <= s < 200 else 1.0)
    flagged = {s for s, f in slide(table)}
    assert 200 in flagged and max(flagged) < 240


def test_too_little_data_is_not_judged() -> None:
    table = make_table(8, 8, 5, factor=lambda r, s: 2.0 if r == 1 else 1.0)
    assert detect_stragglers(table) == []  # fewer than min_steps
    assert detect_stragglers({}) == []
    assert [f.rank for f in detect_stragglers(table, cfg=StragglerConfig(min_steps=5))] == [1]


def test_table_from_store_rows() -> None:
    rows: list[dict[str, Any]] = [
        {"step": 1, "rank": 0, "data_s": 0.01, "compute_s": 0.09},
        {"step": 1, "rank": 1, "data_s": None, "compute_s": 0.2},
        {"step": 1, "rank": 2, "data_s": None, "compute_s": None},
        {"step": 2, "rank": 0, "data_s": float("nan"), "compute_s": 0.1},
    ]
    assert pre_collective_table(rows) == {1: {0: pytest.approx(0.1), 1: 0.2}}


def test_config_is_validated_with_the_fix_named() -> None:
    with pytest.raises(ValueError,
                       match=r"straggler\.threshold must be in \(0, 1\) \(got 1\.5\); try 0\.75"):
        StragglerConfig(threshold=1.5)
    with pytest.raises(ValueError,
                       match=r"straggler\.min_steps must be <= window_steps = 10 \(got 20\)"):
        StragglerConfig(window_steps=10, min_steps=20)


def test_millisecond_steps_are_not_judged_below_the_absolute_floor() -> None:
    # 2 ms of compute where scheduler noise alone makes one rank 2x slower: not a straggler
    # (its excess is under min_excess_s); the same ratio at 20 ms is.
    assert slide({s: {0: 0.002, 1: 0.0045} for s in range(200)}) == []
    hits = slide({s: {0: 0.02, 1: 0.045} for s in range(200)})
    assert hits and {f.rank for _, f in hits} == {1}


def test_two_ranks_one_1_5x_slower_score_two_thirds_and_the_finding_says_the_same() -> None:
    """The score is the median of the *other* ranks: with two ranks the slow one does not
    pull its own reference half-way up (the median of all ranks would say 0.833)."""
    table = {s: {0: 0.2, 1: 0.3} for s in range(30)}
    scores = straggler_scores(table)
    assert scores[1].score == pytest.approx(2 / 3) and scores[1].slow
    assert scores[0].score == pytest.approx(1.5) and not scores[0].slow
    assert scores[1].excess_s == pytest.approx(0.1)
    [f] = detect_stragglers(table)
    assert f.rank == 1 and f.details["window_score"] == round(scores[1].score, 4)


def test_scores_cover_the_newest_window_of_steps_only() -> None:
    table = {s: {0: 0.2, 1: 0.3 if s < 10 else 0.2} for s in range(30)}
    assert straggler_scores(table)[1].score == pytest.approx(1.0)  # steps 10-29
    assert straggler_scores({s: {0: 0.2, 1: 0.2} for s in range(5)}) == {}  # < min_steps

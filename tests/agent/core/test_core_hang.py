"""Hang detector: learned deadline, start-up/warm-up/checkpoint allowances, naming the rank."""

from __future__ import annotations

import random
import statistics
from typing import Any

import pytest

from trainwarden.agent.core.hang import (
    HangConfig,
    ProgressWindow,
    RankProgress,
    detect_hang,
    hang_deadline,
    intervals_from_times,
)

TICK = 0.5  # the evaluator's period
START = 1_000_000.0


def step_times(n: int, step_s: float, jitter: float, seed: int, first_s: float = 0.0
               ) -> list[float]:
    """End times of n steps starting at START; step 0 takes first_s extra."""
    rng = random.Random(seed)
    t, out = START + first_s, []
    for _ in range(n):
        t += step_s * rng.uniform(1 - jitter, 1 + jitter)
        out.append(t)
    return out


def window(times: list[float], now: float, ranks: int = 4, **kw: Any) -> ProgressWindow:
    """What the evaluator would see at ``now``: steps whose report has arrived."""
    seen = [t for t in times if t <= now]
    progress = {r: RankProgress(step=len(seen) - 1, t=seen[-1]) for r in range(ranks)} if seen \
        else {}
    return ProgressWindow(attempt_started_at=START, ranks=progress, steps_in_attempt=len(seen),
                          step_intervals=intervals_from_times(seen[-200:]), **kw)


def first_detection(times: list[float], t_from: float, t_to: float, cfg: HangConfig,
                    **kw: Any) -> float | None:
    now = t_from
    while now <= t_to:
        if detect_hang(window(times, now, **kw), now, cfg):
            return now
        now += TICK
    return None


@pytest.mark.parametrize("step_s", [0.2, 1.0, 10.0])
def test_hang_detected_after_deadline_within_target(step_s: float) -> None:
    cfg = HangConfig()
    times = step_times(300, step_s, jitter=0.05, seed=1)
    last = times[-1]  # the run hangs after its 300th step
    target = max(30.0, 10 * statistics.median(intervals_from_times(times)))
    deadline = hang_deadline(window(times, last), cfg).seconds
    found = first_detection(times, last, last + 3 * target, cfg)
    assert found is not None
    assert found - last > deadline  # not before the deadline
    assert found - last <= target + TICK  # within the target (plus one evaluator tick)
    [f] = detect_hang(window(times, found), found, cfg)
    assert (f.kind, f.severity, f.step) == ("hang", "incident", 299)
    assert f.details["phase"] == "steady"
    assert "no step progress" in f.message


@pytest.mark.parametrize("seed", range(5))
def test_no_hang_on_a_jittery_run(seed: int) -> None:
    times = step_times(600, 0.5, jitter=0.5, seed=seed, first_s=20.0)
    assert first_detection(times, START, times[-1], HangConfig()) is None


def test_startup_allowance_then_hang() -> None:
    cfg = HangConfig(startup_s=120.0)
    empty = ProgressWindow(attempt_started_at=START)
    assert detect_hang(empty, START + 119.0, cfg) == []
    [f] = detect_hang(empty, START + 121.0, cfg)
    assert f.kind == "hang" and f.details["phase"] == "startup" and f.step is None
    assert "after the attempt started" in f.message


def test_slow_warmup_steps_are_not_a_hang() -> None:
    # Step 0 takes 4 minutes (compilation), step 1 two minutes (DDP bucket rebuild), then 1 s.
    times = [START + 240.0, START + 360.0]
    times += [times[-1] + i + 1.0 for i in range(100)]
    cfg = HangConfig()
    assert first_detection(times, START, times[-1], cfg) is None
    # ... but warm-up has a deadline too: the third step never comes.
    found = first_detection(times[:2], times[1], times[1] + 400.0, cfg)
    assert found is not None and found - times[1] > cfg.warmup_s
    assert detect_hang(window(times[:2], found), found, cfg)[0].details["phase"] == "warmup"


def test_checkpoint_pause_is_not_a_hang_until_its_own_allowance() -> None:
    cfg = HangConfig(checkpoint_s=120.0)
    times = step_times(200, 1.0, jitter=0.1, seed=3)
    last = times[-1]
    saving: dict[str, Any] = {"checkpoint_since": last + 0.2}
    # A 100 s save: quiet throughout, though far past the 30 s steady deadline.
    assert first_detection(times, last, last + 100.0, cfg, **saving) is None
    assert first_detection(times, last, last + 100.0, cfg) is not None  # without the flag
    # A save that never ends: a hang once the save allowance is spent.
    found = first_detection(times, last, last + 400.0, cfg, **saving)
    assert found is not None and 120.0 < found - last <= 121.0
    assert "checkpoint" in detect_hang(window(times, found, **saving), found, cfg)[0].details[
        "phase"]
    # Saves known to take long raise the allowance (save_k x the longest).
    slow = {**saving, "recent_save_s": [100.0]}
    assert first_detection(times, last, last + 250.0, cfg, **slow) is None


def test_teardown_after_the_training_loop_is_not_a_hang_until_its_own_allowance() -> None:
    """After the last step a script evaluates, saves and shuts down: minutes with no step.
    Once a rank reported its loop done that is the finishing phase, not a hang."""
    cfg = HangConfig(finish_s=300.0)
    times = step_times(200, 1.0, jitter=0.1, seed=4)
    last = times[-1]
    done = {"finished_at": last + 0.1}
    # A 4-minute final evaluation: quiet throughout, far past the 25 s steady deadline.
    assert first_detection(times, last, last + 240.0, cfg, **done) is None
    assert first_detection(times, last, last + 240.0, cfg) is not None  # without the report
    # A teardown that never ends (a shutdown stuck in a collective) is still called, later.
    found = first_detection(times, last, last + 400.0, cfg, **done)
    assert found is not None
    assert 300.0 < found - last <= 301.0
    assert detect_hang(window(times, found, **done), found, cfg)[0].details["phase"] == \
        "finishing"


def test_brief_stall_that_recovers_is_quiet() -> None:
    rng = random.Random(7)
    times = step_times(150, 1.0, jitter=0.1, seed=7)
    times.append(times[-1] + 25.0)  # a 25 s stall (storage hiccup), then progress again
    for _ in range(150):
        times.append(times[-1] + rng.uniform(0.9, 1.1))
    assert first_detection(times, START, times[-1], HangConfig()) is None


def test_rare_long_intervals_the_run_survived_raise_the_deadline() -> None:
    cfg = HangConfig()
    times = step_times(300, 1.0, jitter=0.05, seed=4)
    now = times[-1] + 50.0  # an evaluation pass that takes 50 s
    assert detect_hang(window(times, now), now, cfg)  # unknown: looks like a hang
    w = window(times, now, longest_interval_s=45.0)
    assert detect_hang(w, now, cfg) == []  # the run had a 45 s pause before: 1.5 x 45 s
    assert hang_deadline(w, cfg).seconds == pytest.approx(67.5)


def test_hang_names_the_rank_furthest_behind() -> None:
    t = START + 500.0
    ranks = {r: RankProgress(step=120, t=t) for r in range(8)}
    ranks[5] = RankProgress(step=118, t=t - 2.0)
    ranks[2] = RankProgress(step=119, t=t - 1.0)
    w = ProgressWindow(attempt_started_at=START, ranks=ranks, steps_in_attempt=121,
                       step_intervals=[1.0] * 100, nodes={5: "gpu-b", 2: "gpu-a"})
    assert detect_hang(w, t + 24.0) == []
    [f] = detect_hang(w, t + 26.0)
    assert (f.kind, f.rank, f.node, f.step) == ("hang", 5, "gpu-b", 120)
    assert f.details["behind"] == {"5": 118, "2": 119}
    assert "rank 5 on gpu-b" in f.message


def test_rank_left_behind_while_others_progress_is_an_event() -> None:
    t = START + 500.0
    ranks = {r: RankProgress(step=300, t=t) for r in range(4)}
    ranks[3] = RankProgress(step=200, t=t - 100.0)
    w = ProgressWindow(attempt_started_at=START, ranks=ranks, steps_in_attempt=301,
                       step_intervals=[1.0] * 100, nodes={3: "gpu-d"})
    [f] = detect_hang(w, t + 0.5)
    assert (f.kind, f.severity, f.rank, f.node, f.step) == ("rank_stalled", "event", 3,
                                                            "gpu-d", 200)
    # One step behind (report delivery lag) is normal.
    ranks[3] = RankProgress(step=299, t=t - 1.0)
    assert detect_hang(w, t + 0.5) == []


def test_supervisor_downtime_does_not_count_as_a_stall() -> None:
    times = step_times(100, 1.0, jitter=0.05, seed=5)
    now = times[-1] + 60.0  # the supervisor was down and just came back
    assert detect_hang(window(times, now), now, HangConfig())
    w = window(times, now, observing_since=now - 1.0)
    assert detect_hang(w, now, HangConfig()) == []
    assert detect_hang(w, now + 31.0, HangConfig())


def test_config_is_validated_with_the_fix_named() -> None:
    with pytest.raises(ValueError, match=r"hang\.floor_s must be > 0 \(got 0\)"):
        HangConfig(floor_s=0)
    with pytest.raises(ValueError, match=r"hang\.quantile must be in \[0\.5, 1\] \(got 2\.0\); try"
                       r" 0\.99"):
        HangConfig(quantile=2.0)
    assert HangConfig(floor_s=2.0, startup_s=3.0, warmup_s=2.0, checkpoint_s=2.0).floor_s == 2.0

"""Throughput decay: tokens/s against the run's own reference."""

from __future__ import annotations

import random

import pytest

from trainwarden.supervisor.detect.findings import Finding
from trainwarden.supervisor.detect.throughput import (
    ThroughputConfig,
    ThroughputPoint,
    detect_throughput_decay,
    reference_range,
    reference_rate,
)

TOKENS = 65_536  # per step, all ranks


def run(steps: int, seed: int, noise: float = 0.1, slow: dict[int, float] | None = None
        ) -> list[ThroughputPoint]:
    """Steps of ~0.5 s with noise; ``slow``: step -> factor on the step time. The first 10
    steps are warm-up (3x slower)."""
    rng = random.Random(seed)
    out = []
    for s in range(steps):
        sec = 0.5 * rng.uniform(1 - noise, 1 + noise) * (3.0 if s < 10 else 1.0)
        sec *= (slow or {}).get(s, 1.0)
        out.append(ThroughputPoint(step=s, amount=TOKENS, seconds=sec))
    return out


def slide(points: list[ThroughputPoint], cfg: ThroughputConfig | None = None
          ) -> list[tuple[int, Finding]]:
    """The evaluator: reference fetched once, the newest 100 steps on every step."""
    cfg = cfg or ThroughputConfig()
    a, b = reference_range(0, cfg)
    ref = reference_rate(points[a:b + 1], cfg)
    out: list[tuple[int, Finding]] = []
    for i in range(b + 1, len(points)):
        out.extend((i, f) for f in detect_throughput_decay(points[max(0, i - 99):i + 1],
                                                          reference=ref, cfg=cfg))
    return out


@pytest.mark.parametrize("seed", range(5))
def test_noise_drift_and_single_slow_steps_are_quiet(seed: int) -> None:
    slow = {s: 1 + 0.02 * s / 600 for s in range(600)}  # 2% slower by the end
    slow.update({s: 8.0 for s in range(150, 600, 100)})  # checkpoint saves
    assert slide(run(600, seed, noise=0.2, slow=slow)) == []


@pytest.mark.parametrize("seed", range(5))
def test_a_20pct_drop_is_quiet(seed: int) -> None:
    assert slide(run(400, seed, slow={s: 1 / 0.8 for s in range(200, 400)})) == []


@pytest.mark.parametrize("seed", range(5))
def test_a_sustained_40pct_drop_is_an_event_with_both_figures(seed: int) -> None:
    points = run(400, seed, slow={s: 1 / 0.6 for s in range(250, 400)})
    hits = slide(points)
    assert hits
    first, f = hits[0]
    assert 250 < first <= 250 + 26  # more than half of the 50-step window
    assert (f.kind, f.severity) == ("throughput_decay", "event")
    d = f.details
    assert d["reference_rate"] == pytest.approx(TOKENS / 0.5, rel=0.05)
    assert d["recent_rate"] < 0.7 * d["reference_rate"]
    assert f.step is not None and abs(f.step - 250) <= 3
    assert "tokens/s" in f.message and "lower" in f.message


def test_reference_from_the_points_themselves() -> None:
    cfg = ThroughputConfig(warmup_steps=10, reference_steps=50, window_steps=30, min_points=10,
                           unit="samples/s")
    points = run(200, 1, slow={s: 2.0 for s in range(150, 200)})
    [f] = detect_throughput_decay(points, cfg=cfg)
    assert f.details["drop_pct"] == pytest.approx(50, abs=8)
    assert "samples/s" in f.message
    # Too short to hold both windows apart: nothing judged.
    assert detect_throughput_decay(points[:60], cfg=cfg) == []
    assert detect_throughput_decay(points, reference=0.0, cfg=cfg) == []


def test_config_is_validated_with_the_fix_named() -> None:
    with pytest.raises(ValueError, match=r"throughput\.drop must be in \(0, 1\) \(got 30\)"):
        ThroughputConfig(drop=30)
    with pytest.raises(ValueError,
                       match=r"throughput\.window_steps must be >= min_points = 20 \(got 5\)"):
        ThroughputConfig(window_steps=5)

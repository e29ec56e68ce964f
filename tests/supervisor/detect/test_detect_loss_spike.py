"""Loss-spike and non-finite detector: incidents, transient events, and the quiet hard cases."""

from __future__ import annotations

import math
import random

import pytest

from supervisor.detect.findings import Finding
from supervisor.detect.loss_spike import (
    LossSample,
    LossSpikeConfig,
    LossSpikeTracker,
    detect_loss,
    detect_nonfinite,
    samples_from_pairs,
)

CFG = LossSpikeConfig()


def curve(n: int, seed: int, noise: float = 0.03, start: float = 2.5, end: float = 2.0
          ) -> list[float]:
    """A slowly improving loss with relative Gaussian noise."""
    rng = random.Random(seed)
    return [(end + (start - end) * math.exp(-s / 300)) * (1 + rng.gauss(0, noise))
            for s in range(n)]


def slide(losses: list[float], cfg: LossSpikeConfig = CFG, first_step: int = 0
          ) -> list[tuple[int, Finding]]:
    """Drive the detector as the evaluator does, once per new step: a tracker fed the new
    step, checked against the pure function of the window while the spike is young.
    Returns (newest step, finding) pairs."""
    pairs = [(first_step + i, x) for i, x in enumerate(losses)]
    tracker = LossSpikeTracker(cfg)
    out: list[tuple[int, Finding]] = []
    for i in range(len(pairs)):
        found = tracker.feed(samples_from_pairs(pairs[i:i + 1]))
        out.extend((pairs[i][0], f) for f in found)
        if i % 5 and not found:
            continue
        win = pairs[max(0, i + 1 - cfg.lookback_steps): i + 1]
        pure = detect_loss(samples_from_pairs(win), cfg)
        young = [f for f in found if f.step is not None and f.step - win[0][0] >= cfg.window_steps]
        assert all(f in pure for f in young)  # same answer, as long as history is in view
        assert found or not pure
    return out


# --- quiet ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_lr_warmup_curve_falling_fast_is_quiet(seed: int) -> None:
    rng = random.Random(seed)
    # Loss falls from ~11 to ~3 in 300 steps (LR warm-up), then flattens; 5% noise.
    losses = [(3 + 8 * math.exp(-s / 60)) * (1 + rng.gauss(0, 0.05)) for s in range(600)]
    assert slide(losses) == []


@pytest.mark.parametrize("seed", range(5))
def test_noisy_loss_is_quiet(seed: int) -> None:
    assert slide(curve(800, seed, noise=0.10)) == []


@pytest.mark.parametrize("seed", range(5))
def test_heavy_tailed_noise_with_single_outlier_steps_is_quiet(seed: int) -> None:
    rng = random.Random(seed + 50)
    losses = curve(600, seed)
    for s in range(40, 600, 45):  # single bad batches, 2-5x the loss
        losses[s + rng.randrange(10)] *= rng.uniform(2, 5)
    assert slide(losses) == []


def test_too_little_history_is_not_judged() -> None:
    # The first steps of a fresh run jump around wildly: nothing to compare with yet.
    losses = [11.0, 30.0, 9.0, 40.0, 8.0, 50.0, 7.0, 60.0, 6.5, 70.0, 6.0, 80.0]
    assert slide(losses) == []


@pytest.mark.parametrize("seed", range(3))
def test_tiny_mad_phase_needs_a_relative_jump(seed: int) -> None:
    # Late in training the loss barely moves: a 20% bump is many MADs, but not a spike.
    losses = curve(300, seed, noise=0.001)
    for s in range(200, 300):
        losses[s] *= 1.2
    assert slide(losses) == []


# --- spikes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_spike_that_does_not_recover_is_an_incident_at_its_start(seed: int) -> None:
    losses = curve(400, seed)
    for s in range(250, 400):
        losses[s] *= 3.0  # diverged
    hits = slide(losses, first_step=1000)
    assert hits
    first, f = hits[0]
    assert (f.kind, f.severity, f.step) == ("loss_spike", "incident", 1250)
    assert first == 1250 + CFG.sustain_steps - 1  # as soon as it has lasted N steps
    assert f.details["baseline_median"] == pytest.approx(2.1, rel=0.1)
    assert f.details["recovered_at_step"] is None
    assert "step 1250" in f.message
    # The answer is stable while the run goes on: same finding, same key, no others.
    assert {g.key for _, g in hits} == {f.key}
    assert [s for s, _ in hits] == list(range(first, 1400))


@pytest.mark.parametrize("seed", range(5))
def test_spike_that_recovers_is_a_transient_event_not_an_incident(seed: int) -> None:
    losses = curve(400, seed)
    for s in range(250, 256):  # six steps high, then back to normal
        losses[s] *= 3.0
    hits = slide(losses)
    assert hits
    assert {f.kind for _, f in hits} == {"loss_spike_transient"}
    f = hits[0][1]
    assert (f.severity, f.step) == ("event", 250)
    assert f.details["recovered_at_step"] == 256
    assert f.details["steps"] == 6
    assert {g.key for _, g in hits} == {f.key}


def test_a_spike_that_recovers_after_n_steps_was_still_an_incident() -> None:
    losses = curve(250, 1)
    for s in range(150, 165):
        losses[s] *= 4.0
    [f] = detect_loss(samples_from_pairs(enumerate(losses)))
    assert (f.kind, f.step, f.details["recovered_at_step"]) == ("loss_spike", 150, 165)
    # Spikes that ended more than lookback_steps ago are no longer reported.
    assert detect_loss(samples_from_pairs(enumerate(losses + curve(400, 1)[250:]))) == []


def test_spike_excluded_from_its_own_baseline() -> None:
    # A long spike does not become "normal": the incident keeps its start and baseline.
    losses = curve(400, 2)
    for s in range(150, 400):
        losses[s] *= 2.5
    [f] = detect_loss(samples_from_pairs(enumerate(losses)))
    assert f.step == 150 and f.details["baseline_median"] < 2.5


def test_a_tracker_rebuilt_from_the_window_agrees() -> None:
    losses = curve(300, 4)
    for s in range(250, 300):  # the window below still holds 50 steps from before it
        losses[s] *= 3.0
    pairs = list(enumerate(losses))
    live = LossSpikeTracker()
    for i in range(0, 300, 7):  # fed in uneven batches, as ticks bring them
        live.feed(samples_from_pairs(pairs[i:i + 7]))
    rebuilt = LossSpikeTracker()
    rebuilt.feed(samples_from_pairs(pairs[-CFG.lookback_steps:]))
    assert live.findings() == rebuilt.findings() != []
    assert live.feed(samples_from_pairs(pairs[:5])) == live.findings()  # old steps: ignored


def test_per_rank_samples_are_merged_per_step() -> None:
    rng = random.Random(3)
    samples = [LossSample(step=s, loss=2.0 * (1 + rng.gauss(0, 0.02)) * (3 if s >= 80 else 1),
                          rank=r, t=1000.0 + s) for s in range(120) for r in range(4)]
    [f] = detect_loss(samples)
    assert (f.kind, f.step, f.started_at) == ("loss_spike", 80, 1080.0)


# --- non-finite ------------------------------------------------------------------------------


def test_nan_loss_is_an_incident_at_once_naming_step_and_rank() -> None:
    losses = curve(100, 0)
    samples = [LossSample(step=s, loss=x / 2, rank=r, grad_norm=1.0)
               for s, x in enumerate(losses) for r in range(2)]
    samples[2 * 70 + 1] = LossSample(step=70, loss=float("nan"), rank=1, grad_norm=1.0)
    # The evaluator's window ends at step 70: the finding is there at once.
    [f] = detect_loss([x for x in samples if x.step <= 70])
    assert (f.kind, f.severity, f.step, f.rank) == ("nonfinite", "incident", 70, 1)
    assert "step 70" in f.message and "rank 1" in f.message
    # Later steps, also NaN, do not move it.
    samples += [LossSample(step=s, loss=float("nan"), rank=r) for s in (100, 101) for r in (0, 1)]
    assert detect_nonfinite(samples) == f.__class__(**{**f.__dict__, "details": {
        **f.details, "samples": 5, "steps": 3}})


def test_inf_grad_norm_is_nonfinite() -> None:
    pairs = [(s, 2.0) for s in range(50)]
    grads = [(s, 1.0 if s != 33 else math.inf) for s in range(50)]
    [f] = detect_loss(samples_from_pairs(pairs, grads))
    assert (f.kind, f.step, f.rank) == ("nonfinite", 33, None)
    assert f.details["fields"] == ["grad_norm"]


def test_none_loss_is_missing_not_nonfinite() -> None:
    assert detect_loss([LossSample(step=s, loss=None) for s in range(40)]) == []


def test_config_is_validated_with_the_fix_named() -> None:
    with pytest.raises(ValueError, match="min_history must be in"):
        LossSpikeConfig(window_steps=10, min_history=20)
    with pytest.raises(ValueError, match="z must be > 0"):
        LossSpikeConfig(z=0)
    assert LossSpikeConfig(sustain_steps=3, transient_min_steps=2).lookback_steps > 0

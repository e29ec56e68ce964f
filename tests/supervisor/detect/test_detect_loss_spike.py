"""Loss-spike and non-finite detector: incidents, transient events, and the quiet hard cases."""

from __future__ import annotations

import math
import random
import re

import pytest

from tests.loss_traces import Trace, label_trace, load_corpus
from trainwarden.supervisor.detect.findings import Finding
from trainwarden.supervisor.detect.loss_spike import (
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


# Steps from a spike's start until a spike that stays is called: the whole recovery window.
CALLED_AFTER = CFG.recovery_window_steps


@pytest.mark.parametrize("seed", range(5))
def test_spike_that_does_not_recover_is_an_incident_at_its_start(seed: int) -> None:
    losses = curve(400, seed)
    for s in range(250, 400):
        losses[s] *= 3.0  # diverged, and stays there
    hits = slide(losses, first_step=1000)
    assert hits
    first, f = hits[0]
    assert (f.kind, f.severity, f.step) == ("loss_spike", "incident", 1250)
    assert first == 1250 + CALLED_AFTER  # as soon as it is known not to be back in time
    assert f.details["detected_at_step"] == first and f.details["rule"] == "window"
    assert f.details["baseline_median"] == pytest.approx(2.1, rel=0.1)
    assert f.details["recovered_at_step"] is None
    assert "step 1250" in f.message and "within 50 steps" in f.message
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


@pytest.mark.parametrize("high_for", [10, 20, 40])
def test_spike_back_within_the_window_is_transient_however_long_it_was_high(
        high_for: int) -> None:
    # Ten steps high was enough for an incident before; a spike that comes back by itself
    # within the recovery window costs nothing a rollback would save.
    losses = curve(400, 1)
    for s in range(150, 150 + high_for):
        losses[s] *= 4.0
    hits = slide(losses)
    assert {f.kind for _, f in hits} == {"loss_spike_transient"}, hits
    f = hits[0][1]
    assert f.step == 150 and f.details["high_steps"] == high_for
    assert f.details["recovered_at_step"] == 150 + high_for
    # Reported until it has slid out of the lookback.
    assert detect_loss(samples_from_pairs(enumerate(losses + curve(500, 1)[400:]))) == []


def test_a_spike_back_only_after_the_window_stays_an_incident() -> None:
    losses = curve(300, 1)
    for s in range(150, 215):  # 65 steps high, then back
        losses[s] *= 4.0
    [f] = detect_loss(samples_from_pairs(enumerate(losses)))
    assert (f.kind, f.step, f.details["recovered_at_step"]) == ("loss_spike", 150, 215)
    assert f.details["detected_at_step"] == 150 + CALLED_AFTER


def test_only_steps_above_the_threshold_count_toward_sustained() -> None:
    # One step in three is high, the others are near the baseline: that counted as ten steps
    # of a spike after ten steps (steps back inside an open spike were counted).
    losses = curve(300, 2)
    for s in range(150, 210, 3):
        losses[s] *= 4.0
    tracker = LossSpikeTracker()
    kinds = set()
    for pair in enumerate(losses):
        kinds |= {f.kind for f in tracker.feed(samples_from_pairs([pair]))}
    assert kinds == {"loss_spike_transient"}


def test_a_spike_that_hovers_between_back_and_high_needs_enough_high_steps() -> None:
    # Five high steps, then 80 steps at 1.35x: not back (1.25x), not high (1.5x): past the
    # window, but with only five high steps it is not a spike that stays.
    losses = curve(400, 3, noise=0.01)
    for s in range(150, 155):
        losses[s] *= 3.0
    for s in range(155, 235):
        losses[s] *= 1.35
    hits = slide(losses)
    assert hits and {f.kind for _, f in hits} == {"loss_spike_transient"}, hits
    assert hits[0][1].details["high_steps"] == 5


@pytest.mark.parametrize("seed", range(3))
def test_divergence_that_keeps_rising_is_called_early(seed: int) -> None:
    losses = curve(400, seed)
    for s in range(250, 400):
        losses[s] *= 1.15 ** (s - 249)  # the LR is too high: the loss grows every step
    hits = slide(losses)
    first, f = hits[0]
    assert f.kind == "loss_spike" and f.details["rule"] == "rising", f
    assert first - f.step < CFG.rise_steps + 5  # long before the window ran out
    assert f.details["detected_at_step"] == first
    assert "still rising" in f.message


def test_a_loss_that_climbs_to_nan_names_where_the_climb_started() -> None:
    losses = curve(300, 4)
    for s in range(200, 212):
        losses[s] *= 1.3 ** (s - 199)
    losses[212:] = [math.nan] * 88
    found = detect_loss(samples_from_pairs(enumerate(losses[:213])))
    nf = next(f for f in found if f.kind == "nonfinite")
    assert nf.step == 212 and nf.details["start_step"] == 201  # the first high step


def test_spike_excluded_from_its_own_baseline() -> None:
    # A long spike does not become "normal": the incident keeps its start and baseline.
    losses = curve(400, 2)
    for s in range(150, 400):
        losses[s] *= 2.5
    [f] = detect_loss(samples_from_pairs(enumerate(losses)))
    assert f.step == 150 and f.details["baseline_median"] < 2.5


def test_a_tracker_rebuilt_from_the_window_agrees() -> None:
    losses = curve(320, 4)
    for s in range(250, 320):  # the window below still holds 50 steps from before it
        losses[s] *= 3.0
    pairs = list(enumerate(losses))
    live = LossSpikeTracker()
    for i in range(0, 320, 7):  # fed in uneven batches, as ticks bring them
        live.feed(samples_from_pairs(pairs[i:i + 7]))
    rebuilt = LossSpikeTracker()
    rebuilt.feed(samples_from_pairs(pairs[-CFG.lookback_steps:]))
    assert live.findings() == rebuilt.findings() != []
    assert live.feed(samples_from_pairs(pairs[:5])) == live.findings()  # old steps: ignored


def test_per_rank_samples_are_merged_per_step() -> None:
    rng = random.Random(3)
    samples = [LossSample(step=s, loss=2.0 * (1 + rng.gauss(0, 0.02)) * (3 if s >= 80 else 1),
                          rank=r, t=1000.0 + s) for s in range(160) for r in range(4)]
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
    with pytest.raises(ValueError, match=re.escape(
            "loss.min_history must be <= window_steps = 10 (got 20)")):
        LossSpikeConfig(window_steps=10, min_history=20)
    with pytest.raises(ValueError, match=re.escape("loss.z must be > 0 (got 0); try 6")):
        LossSpikeConfig(z=0)
    with pytest.raises(ValueError, match=re.escape(
            "loss.recovery_window_steps must be >= sustain_steps = 10 (got 5); a spike cannot")):
        LossSpikeConfig(recovery_window_steps=5)
    assert LossSpikeConfig(sustain_steps=3, transient_min_steps=2).lookback_steps > 0


# --- the corpus of real loss traces ----------------------------------------------------------

CORPUS = load_corpus()
WINDOW = CFG.recovery_window_steps


@pytest.mark.parametrize("trace", CORPUS, ids=lambda t: t.name)
def test_corpus_label_is_what_its_own_curve_says(trace: Trace) -> None:
    label = label_trace(trace.loss, trace.grad_norm)
    assert (label.label, label.start_step) == (trace.label, trace.start_step)


def first_seen(trace: Trace) -> dict[tuple[str, int | None], tuple[int, Finding]]:
    """Each finding of the trace fed one step at a time, with the step it first came at."""
    tracker = LossSpikeTracker()
    out: dict[tuple[str, int | None], tuple[int, Finding]] = {}
    for s, (loss, grad) in enumerate(zip(trace.loss, trace.grad_norm, strict=True)):
        for f in tracker.feed([LossSample(step=s, loss=loss, grad_norm=grad)]):
            out.setdefault((f.kind, f.step), (s, f))
    return out


@pytest.mark.parametrize("trace", [t for t in CORPUS if t.label in ("clean", "transient")],
                         ids=lambda t: t.name)
def test_corpus_clean_run_or_spike_that_comes_back_is_no_incident(trace: Trace) -> None:
    incidents = [f for _, f in first_seen(trace).values() if f.severity == "incident"]
    assert incidents == []


@pytest.mark.parametrize("trace", [t for t in CORPUS if t.label == "sustained"],
                         ids=lambda t: t.name)
def test_corpus_spike_that_stays_is_an_incident_within_the_window_plus_10(
        trace: Trace) -> None:
    start = trace.start_step
    assert start is not None
    hits = sorted((s, f) for (kind, _), (s, f) in first_seen(trace).items()
                  if kind == "loss_spike")
    assert hits, trace.meta["label_details"]
    seen, f = hits[0]
    assert seen - start <= WINDOW + 10, (seen, f.message)
    assert f.details["detected_at_step"] == seen  # the step its rule held
    assert abs(f.step - start) <= 5, f.message  # where the curve says it started


@pytest.mark.parametrize("trace", [t for t in CORPUS if t.label == "nan"],
                         ids=lambda t: t.name)
def test_corpus_nan_is_an_incident_at_once(trace: Trace) -> None:
    found = first_seen(trace)
    seen, f = found[("nonfinite", trace.start_step)]
    assert seen == trace.start_step and f.severity == "incident"
    # A climb before it, if called, was called before the NaN.
    assert all(s < seen for (kind, _), (s, _f) in found.items() if kind == "loss_spike")

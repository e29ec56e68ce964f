"""The simulated long run: the ETTR accumulator on a Poisson failure schedule agrees with
Meta's expected-ETTR model, and each fault kind lands in its part."""

from __future__ import annotations

import math

import pytest

from supervisor.goodput.interval import expected_ettr
from supervisor.goodput.simulate import FaultKind, SimConfig, events, simulate

CRASH = FaultKind("crash", 1.0, detect_s=1.0, restart_s=9.0)


def test_agrees_with_meta_s_model() -> None:
    cfg = SimConfig(mtbf_s=3600.0, days=10, step_s=10.0, interval_s=600.0, stall_s=2.0,
                    kinds=(CRASH,), seed=3)
    r = simulate(cfg)
    model = expected_ettr(nodes=1, rate_per_node_s=1 / 3600, restart_s=10.0,
                          interval_s=600.0, save_stall_s=2.0)
    assert r.faults["crash"] == pytest.approx(10 * 24, rel=0.15)  # Poisson, ~240
    assert r.breakdown.ettr == pytest.approx(model, abs=0.01)
    b = r.breakdown
    # 1 s of detection and 9 s of restart per fault, exactly
    assert b.detection == pytest.approx(r.faults["crash"] * 1.0)
    assert b.restart == pytest.approx(r.faults["crash"] * 9.0)
    assert sum(b.parts().values()) == pytest.approx(b.wall_s)


def test_no_faults_costs_only_the_saves() -> None:
    cfg = SimConfig(mtbf_s=math.inf, days=0.25, step_s=1.0, interval_s=100.0, stall_s=1.0,
                    kinds=(CRASH,))
    b = simulate(cfg).breakdown
    assert b.ettr == pytest.approx(100 / 101, abs=1e-4)
    assert b.lost == 0.0


def test_a_spike_trains_until_detected_and_rolls_back_before_it() -> None:
    spike = FaultKind("loss_spike", 1.0, detect_s=30.0, restart_s=5.0,
                      trains_until_detected=True)
    cfg = SimConfig(mtbf_s=2000.0, days=0.4, step_s=1.0, interval_s=100.0, stall_s=0.0,
                    kinds=(spike,), seed=5)
    r = simulate(cfg)
    b = r.breakdown
    assert b.detection == 0.0  # the detection time is step time, thrown away by the rollback
    # the old workers' step in flight at the detection overlaps the restart: step time wins
    assert r.faults["loss_spike"] * 4.0 <= b.restart <= r.faults["loss_spike"] * 5.0
    assert b.lost >= r.faults["loss_spike"] * 30.0  # at least the steps while detecting
    resumed = [e for e in events(cfg) if type(e).__name__ == "Resumed"]
    assert all(e.step % 100 == 0 for e in resumed)  # always a checkpoint's step


def test_deterministic_for_a_seed() -> None:
    cfg = SimConfig(mtbf_s=1800.0, days=0.25, step_s=2.0, interval_s=120.0, stall_s=1.0,
                    kinds=(CRASH,), seed=9)
    assert simulate(cfg).breakdown == simulate(cfg).breakdown


def test_shares_must_add_up() -> None:
    with pytest.raises(ValueError, match="shares"):
        SimConfig(mtbf_s=1.0, days=1, step_s=1.0, interval_s=1.0, stall_s=0.0,
                  kinds=(FaultKind("crash", 0.5, 1.0, 1.0),))

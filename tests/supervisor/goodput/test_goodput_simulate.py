"""The simulated long run: the ETTR accumulator on a Poisson failure schedule agrees with
Meta's expected-ETTR model, and each fault kind lands in its part."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from trainwarden.supervisor.goodput.ettr import CheckpointSaved, Incident, Resumed
from trainwarden.supervisor.goodput.interval import expected_ettr
from trainwarden.supervisor.goodput.simulate import FaultKind, SimConfig, events, simulate

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
    # the detection time (steps trained from the spike to its incident) is detection once the
    # rollback throws those steps away
    assert b.detection == pytest.approx(r.faults["loss_spike"] * 30.0)
    # the old workers' step in flight at the detection overlaps the restart: step time wins
    assert r.faults["loss_spike"] * 4.0 <= b.restart <= r.faults["loss_spike"] * 5.0
    assert b.lost >= r.faults["loss_spike"] * 1.0  # at least the step in flight at each
    resumed = [e for e in events(cfg) if type(e).__name__ == "Resumed"]
    assert all(e.step % 100 == 0 for e in resumed)  # always a checkpoint's step


def test_deterministic_for_a_seed() -> None:
    cfg = SimConfig(mtbf_s=1800.0, days=0.25, step_s=2.0, interval_s=120.0, stall_s=1.0,
                    kinds=(CRASH,), seed=9)
    assert simulate(cfg).breakdown == simulate(cfg).breakdown


def test_shares_must_add_up() -> None:
    with pytest.raises(ValueError, match=r"^SimConfig\.kinds must be fault kinds whose shares "
                                         r"add up to 1 \(got 0\.5\)"):
        SimConfig(mtbf_s=1.0, days=1, step_s=1.0, interval_s=1.0, stall_s=0.0,
                  kinds=(FaultKind("crash", 0.5, 1.0, 1.0),))


def test_an_asynchronous_save_costs_its_staging_and_is_usable_once_written() -> None:
    """Staging 0.5 s, written 30 s later: with no faults only the staging is checkpoint time
    (accounted when the save completes); a fault inside the write restores the save before."""
    clean = SimConfig(mtbf_s=math.inf, days=0.25, step_s=1.0, interval_s=100.0, stall_s=0.5,
                      write_s=30.0, kinds=(CRASH,))
    b = simulate(clean).breakdown
    saves = [e for e in events(clean) if isinstance(e, CheckpointSaved)]
    assert b.checkpoint == pytest.approx(len(saves) * 0.5)
    assert b.other == pytest.approx(0.0, abs=1e-6)
    assert all(e.released_at == pytest.approx(e.t - 30.0) for e in saves)
    faulty = dataclasses.replace(clean, mtbf_s=900.0, seed=4)
    evs = events(faulty)
    done: list[CheckpointSaved] = []
    restores = 0
    for e in evs:
        if isinstance(e, CheckpointSaved):
            done.append(e)
        elif isinstance(e, Incident):
            fault = e.t_fault or e.t_detected
            target = max((s.step for s in done if s.t <= fault), default=0)
            resumed = next(x for x in evs if isinstance(x, Resumed) and x.t >= e.t_detected)
            assert resumed.step == target
            restores += 1
    assert restores > 5


def test_a_save_due_while_the_last_is_still_written_waits_for_it() -> None:
    cfg = SimConfig(mtbf_s=math.inf, days=0.05, step_s=1.0, interval_s=10.0, stall_s=0.5,
                    write_s=25.0, kinds=(CRASH,))
    saves = [e for e in events(cfg) if isinstance(e, CheckpointSaved)]
    assert len(saves) > 10
    # after the first, each save waits out the rest of the previous write (its stall: the
    # wait and the staging), so they come at one steady pace, not every 10 s
    gaps = [b.t - a.t for a, b in itertools.pairwise(saves)]
    assert gaps[1:] == [pytest.approx(gaps[1])] * len(gaps[1:])
    assert all(s.stall_s > 0.5 for s in saves[1:])
    assert simulate(cfg).breakdown.checkpoint == pytest.approx(sum(s.stall_s for s in saves))

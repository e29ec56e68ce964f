"""Restart anatomy: seconds per phase, unknown (not 0) where a milestone is missing."""

from __future__ import annotations

import pytest

from trainwarden.supervisor.goodput.anatomy import MILESTONES, PHASES, anatomy

FULL = {"decided": 100.0, "workers_stopped": 102.5, "torchrun_started": 103.0,
        "rendezvous_done": 107.0, "preflight_done": 107.5,
        "checkpoint_loaded": 108.5, "first_step": 110.0}


def test_every_phase_from_complete_milestones() -> None:
    a = anatomy(FULL)
    assert a.phases == {"stop_workers": 2.5, "launch": 0.5, "rendezvous": 4.0,
                        "preflight": 0.5, "load_checkpoint": 1.0, "first_step": 1.5}
    assert a.total_s == 10.0
    assert [s.name for s in a.spans] == list(PHASES)
    assert a.notes == ()


def test_a_missing_milestone_leaves_both_phases_unknown_and_merges_the_span() -> None:
    a = anatomy({**FULL, "rendezvous_done": None})
    assert a.phases["rendezvous"] is None
    assert a.phases["preflight"] is None
    assert a.phases["launch"] == 0.5
    merged = [s for s in a.spans if s.start == "torchrun_started"]
    assert len(merged) == 1
    assert merged[0].name == "rendezvous+preflight"
    assert merged[0].end == "preflight_done"
    assert merged[0].seconds == 4.5
    assert a.total_s == 10.0


def test_unknown_end_is_unknown_not_zero() -> None:
    a = anatomy({"decided": 100.0, "workers_stopped": 101.0, "torchrun_started": 101.5})
    assert a.phases["stop_workers"] == 1.0
    assert a.phases["rendezvous"] is None
    assert a.phases["first_step"] is None
    assert a.total_s is None


def test_crash_workers_stopped_before_the_decision() -> None:
    a = anatomy({**FULL, "workers_stopped": 99.0})
    assert a.phases["stop_workers"] == 0.0
    assert a.phases["launch"] == 3.0  # from the decision, not from the exit
    assert sum(v for v in a.phases.values() if v is not None) == a.total_s
    assert any("before the decision" in n for n in a.notes)


def test_clock_skew_never_gives_a_negative_phase() -> None:
    a = anatomy({**FULL, "checkpoint_loaded": 107.2})
    assert a.phases["load_checkpoint"] == 0.0
    assert a.phases["first_step"] == 2.5
    assert all(v is None or v >= 0 for v in a.phases.values())
    assert len(a.notes) == 1


def test_unknown_milestone_names_are_refused() -> None:
    with pytest.raises(ValueError, match="rendezvous_done"):
        anatomy({"decided": 1.0, "rendevous": 2.0})


def test_phases_and_milestones_line_up() -> None:
    assert len(PHASES) == len(MILESTONES) - 1
    d = anatomy(FULL).as_dict()
    assert d["phases_s"] == anatomy(FULL).phases

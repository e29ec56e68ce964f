"""``trainwarden.agent.schedule``: a batch is due at each boundary of the agent's own phase of the
interval, so a steady cadence keeps one interval between batches and a change of interval
takes effect at the next boundary."""

from __future__ import annotations

import itertools
import math

import pytest

from trainwarden.agent.schedule import batch_due


def _sends(start: float, end: float, tick: float, interval: float, phase: float,
           last: float = -math.inf) -> list[float]:
    """When an agent ticking every ``tick`` seconds sends, from ``start`` to ``end``."""
    out = []
    for i in range(round((end - start) / tick)):
        now = start + i * tick
        if batch_due(now=now, last=last, interval_s=interval, phase=phase):
            out.append(now)
            last = now
    return out


def test_the_first_batch_is_due_at_once() -> None:
    assert batch_due(now=5.0, last=-math.inf, interval_s=4.0, phase=0.5)


@pytest.mark.parametrize("phase", [0.0, 0.25, 0.999])
def test_a_steady_cadence_keeps_one_interval_between_batches(phase: float) -> None:
    sends = _sends(1000.0, 1040.0, 0.125, 4.0, phase)
    gaps = [b - a for a, b in itertools.pairwise(sends[1:])]  # (the first: at once)
    assert len(gaps) >= 8
    assert all(abs(g - 4.0) <= 0.125 for g in gaps), gaps


def test_the_slots_are_the_phase_of_the_interval() -> None:
    # phase 0.25 of a 4 s interval: boundaries at t = (k - 0.25) * 4, i.e. 3, 7, 11, ...
    assert not batch_due(now=2.9, last=0.5, interval_s=4.0, phase=0.25)
    assert batch_due(now=3.0, last=0.5, interval_s=4.0, phase=0.25)
    assert not batch_due(now=6.9, last=3.0, interval_s=4.0, phase=0.25)
    assert batch_due(now=7.05, last=3.0, interval_s=4.0, phase=0.25)


def test_a_longer_interval_takes_effect_within_one_new_interval() -> None:
    # a batch at 100.0 on a 1 s cadence, then the advice is 4 s: the next batch comes at the
    # next 4 s boundary of the agent's phase, never more than 4 s later
    for phase in (0.0, 0.3, 0.6, 0.9):
        nxt = _sends(100.05, 110.0, 0.05, 4.0, phase, last=100.0)[0]
        assert 100.0 < nxt <= 104.05, (phase, nxt)


def test_a_clock_stepped_back_does_not_silence_the_agent() -> None:
    # a batch at 1000.0, then the wall clock is set back an hour: the next batch goes at
    # once (the heartbeat in it keeps the node from being called lost), then the cadence
    # resumes on the new clock
    assert batch_due(now=1000.0 - 3600.0, last=1000.0, interval_s=4.0, phase=0.5)
    sends = _sends(-2600.0, -2560.0, 0.125, 4.0, 0.5, last=1000.0)
    assert sends[0] == -2600.0
    assert all(abs(b - a - 4.0) <= 0.125 for a, b in itertools.pairwise(sends[1:])), sends

"""The overload detector and the delivery monitor that feeds it."""

from __future__ import annotations

import math

import pytest

from trainwarden.supervisor.detect.overload import DeliveryReport, OverloadConfig, judge_overload
from trainwarden.supervisor.ingest.delivery import DeliveryMonitor

CFG = OverloadConfig()


def test_a_supervisor_that_keeps_up_is_not_overloaded() -> None:
    rep = DeliveryReport(batches=500, lateness_s=0.05, loop_lag_s=0.01, loop_silent_s=0.2,
                         tick_gap_s=0.5)
    assert judge_overload(rep, CFG) is None


@pytest.mark.parametrize(("rep", "says"), [
    (DeliveryReport(batches=50, lateness_s=7.5), "batches arrive 7.5 s later than usual"),
    (DeliveryReport(loop_lag_s=4.0), "the event loop ran 4.0 s late"),
    (DeliveryReport(loop_silent_s=9.0), "the event loop has not run for 9.0 s"),
    (DeliveryReport(tick_gap_s=40.0), "the evaluator did not tick for 40.0 s"),
])
def test_each_signal_alone_is_an_overload_that_says_why(rep: DeliveryReport, says: str) -> None:
    verdict = judge_overload(rep, CFG)
    assert verdict is not None
    assert says in verdict.reason


def test_lateness_of_too_few_batches_is_not_judged() -> None:
    assert judge_overload(DeliveryReport(batches=2, lateness_s=60.0), CFG) is None


def test_a_bad_setting_names_the_fix() -> None:
    with pytest.raises(ValueError, match=r"overload\.lateness_s must be > 0 \(got 0\); try 3"):
        OverloadConfig(lateness_s=0)


def test_lateness_is_against_each_agents_own_clock_offset() -> None:
    """Agent 1's clock is an hour behind, agent 2's 30 s ahead: neither is late."""
    m = DeliveryMonitor()
    for k in range(20):
        now = 1000.0 + k
        m.observe(1, now - 3600.0 - 0.01, now)
        m.observe(2, now + 30.0 - 0.02, now)
    rep = m.report(1020.0, monotonic=0.0)
    assert rep.batches == 20  # those of the last 10 s
    assert rep.lateness_s is not None and rep.lateness_s < 0.05


def test_batches_sent_long_before_they_arrive_are_late() -> None:
    m = DeliveryMonitor()
    for k in range(10):  # keeping up: sent 10 ms before they arrive
        m.observe(k, 1000.0 - 0.01, 1000.0)
    for k in range(10):  # then the same agents' batches arrive 8 s after they were sent
        m.observe(k, 1001.0, 1009.0)
    rep = m.report(1009.0, monotonic=0.0)
    assert rep.lateness_s == pytest.approx(7.99)  # beyond the usual 10 ms
    assert judge_overload(rep, CFG) is not None


def test_the_window_forgets_old_batches_and_bad_send_times_are_ignored() -> None:
    m = DeliveryMonitor()
    m.observe(1, 100.0, 100.0)
    m.observe(1, 101.0, 120.0)  # 19 s late, at 120
    m.observe(1, math.nan, 121.0)
    m.observe(1, None, 121.0)
    assert m.report(125.0, monotonic=0.0).batches == 1
    assert m.report(131.0, monotonic=0.0).batches == 0


def test_the_loop_beat_says_how_late_and_how_long_ago() -> None:
    m = DeliveryMonitor()
    assert m.report(0.0, monotonic=10.0).loop_silent_s is None
    m.loop_beat(0.3, at=10.0)
    rep = m.report(0.0, monotonic=16.0)
    assert rep.loop_lag_s == pytest.approx(0.3)
    assert rep.loop_silent_s == pytest.approx(6.0)


def test_the_monitor_counts_the_agents_that_sent_in_the_window() -> None:
    m = DeliveryMonitor()
    for a in range(30):
        m.observe(a, 100.0 + a, 100.0 + a)
    assert m.report(129.5, monotonic=0.0).agents == 10  # heard within the last 10 s


@pytest.mark.parametrize(("agents", "overloaded_ago", "want"), [
    (100, None, None),  # few agents, keeping up: their own interval
    (100, 30.0, 4.0),  # behind 30 s ago: still backing off
    (100, 61.0, None),  # 61 s ago: over
    (2048, None, 4.1),  # more agents than 500 batches a second allow at 1 s each
    (1000, 5.0, 4.0),  # behind, and 2 s would do for the rate: the longer
    (4000, 5.0, 8.0),
])
def test_the_advised_batch_interval(agents: int, overloaded_ago: float | None,
                                    want: float | None) -> None:
    from trainwarden.supervisor.control.policy import advised_batch_interval

    got = advised_batch_interval(
        last_overloaded_at=None if overloaded_ago is None else 1000.0 - overloaded_ago,
        now=1000.0, sending_agents=agents, cfg=CFG)
    assert got == want

"""Checkpoint-interval advice against hand-computed values of Young/Daly and Meta's model."""

from __future__ import annotations

import math

import pytest

from trainwarden.supervisor.goodput.interval import (
    LLAMA3_PER_NODE_DAY,
    META_RSC_PER_NODE_DAY,
    IntervalInputs,
    advise,
    expected_ettr,
    optimal_interval,
    young_interval,
)

# 4 failures in 10 days on 8 nodes: MTBF 216,000 s (60 h); 60 s stall per save, 600 s per
# restart, saving every hour.
RUN = IntervalInputs(nodes=8, failures=4, observed_s=10 * 86_400.0, save_stall_s=60.0,
                     restart_s=600.0, interval_s=3600.0)


def test_young_daly_interval() -> None:
    assert young_interval(60.0, 216_000.0) == pytest.approx(5091.1688, rel=1e-7)


def test_meta_expected_ettr_by_hand() -> None:
    # (1 - (4 / 864000) * (600 + 1800)) / (1 + 60 / 3600) = 0.988889 / 1.016667
    e = expected_ettr(nodes=8, rate_per_node_s=4 / (8 * 864_000), restart_s=600.0,
                      interval_s=3600.0, save_stall_s=60.0)
    assert e == pytest.approx(0.9726776, rel=1e-6)


def test_optimal_interval_is_the_maximum_of_the_model() -> None:
    dt = optimal_interval(mtbf_s=216_000.0, restart_s=600.0, save_stall_s=60.0)
    assert dt == pytest.approx(5024.4469, rel=1e-7)  # sqrt(60^2 + 2*60*(216000-600)) - 60
    rate = 1 / (216_000.0 * 8)

    def e(x: float) -> float:
        return expected_ettr(nodes=8, rate_per_node_s=rate, restart_s=600.0, interval_s=x,
                             save_stall_s=60.0)

    assert dt is not None
    assert e(dt) > e(dt - 50) and e(dt) > e(dt + 50)


def test_advice_from_the_run_s_own_failures() -> None:
    a = advise(RUN)
    assert a.rate_source == "observed"
    assert a.mtbf_s == pytest.approx(216_000.0)
    assert a.failures_per_day == pytest.approx(0.4)
    assert a.recommended_s == pytest.approx(5024.4469, rel=1e-7)
    assert a.ettr_current == pytest.approx(0.9726776, rel=1e-6)
    assert a.ettr_recommended == pytest.approx(0.9739609, rel=1e-6)
    assert a.gain == pytest.approx(0.9739609 - 0.9726776, rel=1e-4)
    assert a.inputs == RUN  # the inputs used travel with the advice


def test_no_failures_yet_says_so_and_divides_by_nothing() -> None:
    a = advise(IntervalInputs(nodes=8, failures=0, observed_s=7200.0, save_stall_s=60.0,
                              restart_s=600.0, interval_s=3600.0))
    assert a.rate_source == "none"
    assert a.recommended_s is None and a.mtbf_s is None
    assert "no failures observed yet" in a.note
    assert a.ettr_current == pytest.approx(1 / (1 + 60 / 3600))  # the saves' cost alone


def test_no_failures_and_no_time_observed_either() -> None:
    a = advise(IntervalInputs(nodes=1, failures=0, observed_s=0.0, save_stall_s=0.0,
                              restart_s=0.0))
    assert a.recommended_s is None and a.ettr_current is None


def test_prior_rate_before_the_first_failure() -> None:
    a = advise(IntervalInputs(nodes=2048, failures=0, observed_s=3600.0, save_stall_s=10.0,
                              restart_s=300.0, interval_s=1800.0,
                              prior_per_node_day=META_RSC_PER_NODE_DAY))
    assert a.rate_source == "prior"
    assert a.failures_per_day == pytest.approx(13.312)  # 2048 x 6.5 / 1000
    assert a.mtbf_s == pytest.approx(6490.3846, rel=1e-7)
    assert a.recommended_s == pytest.approx(math.sqrt(100 + 20 * (6490.3846 - 300)) - 10,
                                            rel=1e-6)


def test_failures_faster_than_recovery_recommend_nothing() -> None:
    a = advise(IntervalInputs(nodes=1, failures=10, observed_s=1000.0, save_stall_s=5.0,
                              restart_s=200.0, interval_s=60.0))
    assert a.mtbf_s == pytest.approx(100.0)
    assert a.recommended_s is None
    assert "cannot make progress" in a.note
    assert a.ettr_current == 0.0  # clamped: the model goes negative


def test_free_saves_recommend_no_interval() -> None:
    a = advise(IntervalInputs(nodes=4, failures=2, observed_s=86_400.0, save_stall_s=0.0,
                              restart_s=60.0, interval_s=600.0))
    assert a.recommended_s is None and a.young_s is None
    assert "save as often as storage allows" in a.note


def test_published_rates() -> None:
    per_1000_node_days = {"llama3": LLAMA3_PER_NODE_DAY * 1000,
                          "meta": META_RSC_PER_NODE_DAY * 1000}
    assert per_1000_node_days["llama3"] == pytest.approx(3.789, rel=1e-3)
    assert per_1000_node_days["meta"] == pytest.approx(6.5)


@pytest.mark.parametrize("field,value", [("observed_s", -1.0), ("save_stall_s", math.nan),
                                         ("nodes", 0), ("interval_s", 0.0)])
def test_bad_inputs_name_the_field(field: str, value: float) -> None:
    kw = {"nodes": 1, "failures": 0, "observed_s": 1.0, "save_stall_s": 1.0,
          "restart_s": 1.0, field: value}
    with pytest.raises(ValueError, match=rf"^IntervalInputs\.{field} must be "):
        IntervalInputs(**kw)  # type: ignore[arg-type]

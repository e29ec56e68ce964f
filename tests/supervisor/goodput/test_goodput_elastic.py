"""Wait for a node or shrink: the expected training lost by each option, checked against
hand-computed values, and the choice with its reason."""

from __future__ import annotations

import pytest

from trainwarden.supervisor.goodput.elastic import (
    UNKNOWN_RETURN_S,
    NodeLoss,
    choose,
    lost_shrinking,
    lost_waiting,
)


def loss(**kw: object) -> NodeLoss:
    """A replica of 16 of 2,048 nodes out (Llama 3's data-parallel replica), a 6 s step."""
    base: dict[str, object] = dict(nodes=2048, live_nodes=2032, min_nodes=1792, step_s=6.0,
                                   restart_s=10.0, to_checkpoint_s=30.0, return_s=600.0)
    return NodeLoss(**{**base, **kw})  # type: ignore[arg-type]


def test_each_option_s_loss_by_hand() -> None:
    x = loss()
    assert lost_waiting(x) == 600.0 + 10.0
    # two restarts, then (600 - 10 + 30) s at 2032/2048 of the rate
    assert lost_shrinking(x) == pytest.approx(20.0 + 620.0 * 16 / 2048)
    half = loss(nodes=2, live_nodes=1, min_nodes=1, efficiency=0.5)
    assert lost_shrinking(half) == pytest.approx(20.0 + 620.0 * 0.75)
    # a node back before the shrink's restart ends: shrunk only until the checkpoint
    soon = loss(return_s=5.0)
    assert lost_shrinking(soon) == pytest.approx(20.0 + 30.0 * 16 / 2048)
    assert lost_waiting(soon) == 15.0


def test_shrinking_pays_unless_the_node_is_back_within_about_a_restart() -> None:
    c = choose(loss())
    assert (c.choice, c.wait_s) == ("shrink", 610.0)
    assert c.reason.startswith("shrink on 2,032 of 2,048 nodes: 24.8 s (~4 steps) lost "
                               "against 10.2 min (~102 steps) waiting (a node expected in "
                               "10.0 min, restart 10.0 s"), c.reason
    assert c.horizon_s == pytest.approx(640.0)  # both back on the full world by then
    assert choose(loss(return_s=5.0)).choice == "wait"
    slow = loss(restart_s=300.0, return_s=60.0)  # an extra 5-minute restart costs more
    assert choose(slow).choice == "wait" and choose(slow).reason.startswith("wait: 6.0 min")
    # a tie waits: one restart, not two
    tie = loss(nodes=2, live_nodes=1, min_nodes=1, restart_s=10.0, to_checkpoint_s=0.0,
               return_s=10.0)
    assert lost_waiting(tie) == lost_shrinking(tie) == 20.0
    assert choose(tie).choice == "wait"


def test_below_min_nodes_it_waits() -> None:
    c = choose(loss(live_nodes=1776))
    assert (c.choice, c.shrink_s, c.horizon_s) == ("wait", None, 610.0)
    assert c.reason == ("wait: 1,776 nodes left is below min_nodes 1,792; a node expected in "
                        "10.0 min, 10.2 min (~102 steps) lost")


def test_an_unknown_return_is_the_documented_default_and_said_so() -> None:
    c = choose(loss(return_s=None))
    assert c.wait_s == UNKNOWN_RETURN_S + 10.0 and c.choice == "shrink"
    assert "return time unknown, taken as 4.0 h" in c.reason


def test_the_inputs_are_bounded() -> None:
    with pytest.raises(ValueError, match=r"^NodeLoss\.live_nodes must be < nodes \(2048\) "
                                         r"\(got 2048\); a loss leaves fewer"):
        loss(live_nodes=2048)
    with pytest.raises(ValueError, match=r"^NodeLoss\.min_nodes must be <= nodes \(2048\)"):
        loss(min_nodes=4096)
    with pytest.raises(ValueError, match=r"^NodeLoss\.return_s must be a finite number >= 0"):
        loss(return_s=float("inf"))
    with pytest.raises(ValueError, match=r"^NodeLoss\.step_s must be a finite number > 0"):
        loss(step_s=0.0)
    with pytest.raises(ValueError, match=r"^NodeLoss\.efficiency must be in \(0, 1\]"):
        loss(efficiency=0.0)

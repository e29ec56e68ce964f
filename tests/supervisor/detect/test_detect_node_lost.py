"""Node lost: heartbeat age against a deadline; and the Finding's deduplication key."""

from __future__ import annotations

import pytest

from trainwarden.supervisor.detect.findings import Finding
from trainwarden.supervisor.detect.node_lost import NodeLostConfig, detect_lost_nodes

NOW = 2_000_000.0


def test_fresh_nodes_are_quiet_and_a_silent_one_is_named() -> None:
    """The default deadline (30 s: the supervisor's) passes a node silent for 29.9 s."""
    beats = {"gpu-a": NOW - 1.0, "gpu-b": NOW - 29.9, "gpu-c": NOW - 45.5}
    [f] = detect_lost_nodes(beats, NOW, ranks={"gpu-c": [8, 9]})
    assert (f.kind, f.severity, f.node, f.started_at) == ("node_lost", "incident", "gpu-c",
                                                          NOW - 45.5)
    assert f.details["age_s"] == pytest.approx(45.5)
    assert "gpu-c" in f.message and "45.5 s" in f.message and "8, 9" in f.message


def test_deadline_is_configurable() -> None:
    beats = {"a": NOW - 3.0, "b": NOW - 1.0}
    assert [f.node for f in detect_lost_nodes(beats, NOW, NodeLostConfig(deadline_s=2.0))] == ["a"]
    assert detect_lost_nodes(beats, NOW) == []
    with pytest.raises(ValueError, match=r"node_lost\.deadline_s must be > 0 \(got 0\); try 30"):
        NodeLostConfig(deadline_s=0)


def test_supervisor_downtime_is_not_node_loss() -> None:
    beats = {"a": NOW - 100.0}
    assert detect_lost_nodes(beats, NOW, observing_since=NOW - 5.0) == []
    assert detect_lost_nodes(beats, NOW + 26.0, observing_since=NOW - 5.0)


def test_finding_key_keeps_exact_steps_only() -> None:
    spike = Finding(kind="loss_spike", severity="incident", message="m", step=12)
    slow = Finding(kind="straggler", severity="incident", message="m", step=12, rank=3)
    assert spike.key == ("loss_spike", 12, None, None)
    assert slow.key == ("straggler", None, 3, None)

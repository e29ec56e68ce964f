"""A node's state, judged once (``control.node_states``, pure): what the API, the CLI and
the dashboard show."""

from __future__ import annotations

import pytest

from trainwarden.agent.core.states import NodeRole
from trainwarden.supervisor.control.node_states import NodeFacts, RunFacts, node_view
from trainwarden.supervisor.enums import NodeState

NOW, LIVE_S = 1000.0, 30.0
MEMBER, SPARE = NodeRole.MEMBER, NodeRole.SPARE


def view(role: NodeRole = MEMBER, reported: str = "running", seen_s: float = 1.0, *,
         replaced: bool = False, lost_at: float | None = None, ended: bool = False,
         waiting: bool = False) -> tuple[NodeState, bool]:
    v = node_view(NodeFacts(role=role, reported=reported, last_seen_at=NOW - seen_s,
                            replaced=replaced, lost_at=lost_at),
                  RunFacts(now=NOW, live_s=LIVE_S, ended=ended, waiting=waiting))
    assert v.seen_s == seen_s
    return v.state, v.stale


@pytest.mark.parametrize(("reported", "state"), [
    ("registered", NodeState.STARTING), ("starting", NodeState.STARTING),
    ("running", NodeState.RUNNING), ("stopping", NodeState.STOPPING),
    ("stopped", NodeState.STOPPED), ("failed", NodeState.FAILED),
    ("finished", NodeState.FINISHED), ("spare", NodeState.WAITING),
    ("from-a-newer-agent", NodeState.STARTING)])
def test_a_live_member_reads_what_its_agent_reports(reported: str, state: NodeState) -> None:
    assert view(reported=reported) == (state, False)


def test_a_silent_node_is_lost_whatever_it_last_reported_and_its_readings_are_stale() -> None:
    assert view(seen_s=30.0) == (NodeState.RUNNING, False)  # within the deadline
    assert view(seen_s=45.0) == (NodeState.LOST, True)
    assert view(SPARE, "spare", seen_s=111.0) == (NodeState.LOST, True)


def test_a_node_confirmed_dead_is_lost_until_it_is_heard_again() -> None:
    assert view(seen_s=2.0, lost_at=NOW - 1.0) == (NodeState.LOST, True)
    assert view(seen_s=0.5, lost_at=NOW - 1.0) == (NodeState.RUNNING, False)  # heard since


def test_a_replaced_node_reads_replaced_never_spare() -> None:
    assert view(SPARE, "running", seen_s=60.0, replaced=True) == (NodeState.REPLACED, True)
    # woken, heard again: a free spare it is (it may take a node rank again)
    assert view(SPARE, "spare", replaced=True) == (NodeState.SPARE, False)
    assert view(SPARE, "spare") == (NodeState.SPARE, False)


def test_a_live_member_of_a_run_waiting_for_a_node_reads_waiting() -> None:
    for reported in ("failed", "stopped", "stopping", "spare"):
        assert view(reported=reported, waiting=True) == (NodeState.WAITING, False)
    assert view(reported="running", waiting=True) == (NodeState.RUNNING, False)
    assert view(seen_s=40.0, waiting=True) == (NodeState.LOST, True)  # the missing node


def test_every_node_of_an_ended_run_reads_finished_or_replaced() -> None:
    assert view(reported="finished", ended=True) == (NodeState.FINISHED, True)
    assert view(SPARE, "stopped", seen_s=90.0, ended=True) == (NodeState.FINISHED, True)
    assert view(seen_s=90.0, ended=True) == (NodeState.FINISHED, True)
    assert view(SPARE, "running", seen_s=90.0, replaced=True, ended=True) == (
        NodeState.REPLACED, True)

"""The agent's states move only as ``AGENT_TRANSITIONS`` lists; a move it does not list is
logged as an error and made all the same (the agent never stops on its own bookkeeping)."""

from __future__ import annotations

import logging

import pytest
from agent_fakes import FakeRun, FakeSupervisor

from trainwarden.agent.core.states import AGENT_TRANSITIONS, AgentState
from trainwarden.agent.loop import UNLISTED_MOVE, Agent


def test_the_table_names_every_state_and_the_agent_never_becomes_registered() -> None:
    assert set(AGENT_TRANSITIONS) == set(AgentState)
    assert AGENT_TRANSITIONS[AgentState.REGISTERED] == frozenset()
    assert all(AgentState.REGISTERED not in to for to in AGENT_TRANSITIONS.values())
    assert all(s not in to for s, to in AGENT_TRANSITIONS.items())  # staying is no move
    # Only a starting agent's first step makes it running.
    assert {s for s, to in AGENT_TRANSITIONS.items() if AgentState.RUNNING in to} == {
        AgentState.STARTING}


def _agent(agents: list[Agent], fake_run: FakeRun, fake: FakeSupervisor) -> Agent:
    agent = Agent(fake_run.config("serve"), transport=fake.transport(), threaded_uplink=False,
                  echo=False)
    agents.append(agent)
    return agent


def test_every_listed_move_is_made_without_an_error(
        agents: list[Agent], fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        caplog: pytest.LogCaptureFixture) -> None:
    agent = _agent(agents, fake_run, fake_supervisor)
    for src, targets in AGENT_TRANSITIONS.items():
        for to in targets:
            agent.state = src
            agent.set_state(to)
            assert agent.state == to
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.allow_unlisted_state_move
def test_an_unlisted_move_is_logged_as_an_error_and_made(
        agents: list[Agent], fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        caplog: pytest.LogCaptureFixture) -> None:
    agent = _agent(agents, fake_run, fake_supervisor)
    agent.state = AgentState.FINISHED
    with caplog.at_level(logging.ERROR, logger="trainwarden.agent.loop"):
        agent.set_state(AgentState.RUNNING)
    assert agent.state == AgentState.RUNNING
    (record,) = [r for r in caplog.records if r.getMessage().startswith(UNLISTED_MOVE)]
    assert record.levelno == logging.ERROR
    assert "finished -> running" in record.getMessage()

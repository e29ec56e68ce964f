"""Every agent of a run leaves when the run ends, and its exit code says how the run ended:
real ``Agent`` objects (fake-torchrun process trees) against the real supervisor (uvicorn on
SQLite, its clock and evaluator in the test's hands)."""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest
from agent_fakes import AGENT_TOKEN, OPERATOR_TOKEN, FakeRun, SupervisorClock

from tests.waiting import wait_for
from trainwarden.agent.config import AgentConfig
from trainwarden.agent.core.states import AgentExit
from trainwarden.agent.loop import Agent

OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


def _agent(agents: list[Agent], fake_run: FakeRun, sup: tuple[str, SupervisorClock, Any],
           node: str, mode: str, *extra: str, spare: bool = False) -> Agent:
    """An agent on the supervisor's clock (its batches fall due as that clock moves)."""
    base, clock, _app = sup
    cfg = AgentConfig(supervisor_url=base, run="leave", node=node, token=AGENT_TOKEN,
                      command=fake_run.command(mode, *extra),
                      state_dir=fake_run.tmp_path / f"state-{node}", spare=spare,
                      stop_grace_s=0.5, flush_timeout_s=5.0, register_wait_s=5.0)
    agent = Agent(cfg, threaded_uplink=False, echo=False, clock=clock)
    agents.append(agent)
    agent.start()
    return agent


def _run(base: str) -> Any:
    return httpx.get(f"{base}/api/v1/runs/leave", headers=OPERATOR, timeout=5).json()


def _events(base: str) -> list[dict[str, Any]]:
    return httpx.get(f"{base}/api/v1/runs/leave/events", headers=OPERATOR,
                     timeout=5).json()["events"]


def _until_ended(agent: Agent, sup_tick: Any, clock: SupervisorClock, *,
                 seconds: float = 45.0) -> int:
    """Tick the agent (and the supervisor, its clock a second on each round) until the agent
    says it ends; the supervisor's clock covers ``seconds`` at most (past the node-lost
    deadline, when an ended run's credentials are revoked)."""
    for _ in range(int(seconds)):
        result = agent.tick()
        if result is not None:
            return result
        sup_tick()
        clock.now += 1.0
        agent.uplink._next_try = 0.0  # no backoff wait in tests
    raise AssertionError(f"the agent did not end within {seconds} s of the supervisor's time")


def test_a_spare_of_a_completed_run_is_told_to_stop_delivers_everything_and_exits_0(
        served_supervisor: tuple[str, SupervisorClock, Any], fake_run: FakeRun,
        agents: list[Agent], caplog: pytest.LogCaptureFixture) -> None:
    """What a user saw instead: the spare's credential revoked 30 s after the completion, its
    re-registration refused (logged as ERROR), two batches left in its spool, exit 3."""
    base, clock, app = served_supervisor
    evaluator = app.state.evaluator
    member = _agent(agents, fake_run, served_supervisor, "node0", "complete", "--steps", "3")
    spare = _agent(agents, fake_run, served_supervisor, "spare0", "serve", spare=True)
    assert spare.role == "spare"
    wait_for(lambda: member.tick() is not None, timeout=20, what="the member to complete")
    member.shutdown("run ended")
    assert member.result == AgentExit.COMPLETED
    evaluator.tick()
    assert _run(base)["status"] == "completed"
    caplog.set_level(logging.INFO)
    code = _until_ended(spare, evaluator.tick, clock)
    spare.shutdown("run ended")
    assert code == AgentExit.COMPLETED == 0
    assert spare.uplink.pending == 0  # everything it spooled was delivered
    assert spare.uplink.refused is None
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    names = [e["name"] for e in _events(base)]
    assert "credentials_revoked" not in names  # it left before any revocation
    # Its credential is revoked once the node-lost deadline has passed, as every agent's of
    # an ended run: by then it has left.
    clock.now += 31.0
    evaluator.tick()
    assert "credentials_revoked" in [e["name"] for e in _events(base)]


@pytest.mark.parametrize(("how", "status", "code"), [
    ("operator", "stopped", AgentExit.STOPPED), ("failed", "failed", AgentExit.FAILED)])
def test_the_exit_code_of_every_agent_says_how_the_run_ended(
        served_supervisor: tuple[str, SupervisorClock, Any], fake_run: FakeRun,
        agents: list[Agent], how: str, status: str, code: int) -> None:
    """A member and a spare; the run is stopped by an operator, or fails (the crash budget
    spent).  What a user saw instead: ``trainwarden agent`` exited 0 for a failed run."""
    base, clock, app = served_supervisor
    evaluator = app.state.evaluator
    member = _agent(agents, fake_run, served_supervisor, "node0", "serve")
    spare = _agent(agents, fake_run, served_supervisor, "spare0", "serve", spare=True)
    wait_for(lambda: member.tick() is None and member.state == "running", timeout=20,
             what="the member's workers to run")
    member.send_batch()
    member.uplink.pump()
    assert _run(base)["status"] == "running"
    if how == "operator":
        r = httpx.post(f"{base}/api/v1/runs/leave/stop", headers=OPERATOR, timeout=5,
                       json={"reason": "enough"})
        assert r.status_code < 300, r.text
    else:
        from trainwarden.supervisor.control import actions, policy
        from trainwarden.supervisor.store import registry

        with app.state.db.write() as conn:
            run = registry.get_run_by_name(conn, name="leave")
            assert run is not None
            actions.apply(conn, run=run, now=clock.now, decision=policy.Stop(
                status="failed", reason="crash budget of 3 spent"))
    assert _run(base)["status"] == status
    for agent in (member, spare):
        got = _until_ended(agent, evaluator.tick, clock, seconds=20)
        agent.shutdown("run ended")
        assert got == code, agent
        assert agent.uplink.pending == 0
    assert len({AgentExit.COMPLETED, AgentExit.FAILED, AgentExit.STOPPED,
                AgentExit.REFUSED}) == 4



def test_the_agents_help_lists_every_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    from trainwarden.agent.cli import main

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for code in AgentExit:
        assert f"\n  {int(code):<3}  " in out, (code, out)

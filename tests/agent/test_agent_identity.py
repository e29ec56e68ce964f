"""The agent's state belongs to the supervisor's identity of the run (its uuid), not to the
run's name: in the default state location (``XDG_STATE_HOME``, no ``--state-dir``) a second
run with the same name archives the first one's state before any worker starts."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from agent_fakes import FakeRun, FakeSupervisor

from tests.waiting import wait_for
from trainwarden.agent import protocol
from trainwarden.agent.config import AgentConfig, default_state_dir
from trainwarden.agent.core.states import AgentExit
from trainwarden.agent.loop import EXIT_REFUSED, Agent


@pytest.fixture
def xdg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    base = tmp_path / "xdg"
    monkeypatch.setenv("XDG_STATE_HOME", str(base))
    return base


def _config(fake_run: FakeRun, mode: str = "serve", *extra: str, **kw: Any) -> AgentConfig:
    """The defaults a user gets: no --state-dir, no --checkpoint-root."""
    kw.setdefault("register_wait_s", 1.0)
    return AgentConfig(supervisor_url="http://supervisor.test", run="run1", node="node1",
                       command=fake_run.command(mode, *extra), token="agent-token",
                       stop_grace_s=0.5, flush_timeout_s=2.0, **kw)


def _agent(agents: list[Agent], cfg: AgentConfig, fake: FakeSupervisor) -> Agent:
    agent = Agent(cfg, transport=fake.transport(), threaded_uplink=False, echo=False)
    agents.append(agent)
    return agent


def _tick_until(agent: Agent, cond: Any, what: str, timeout: float = 10.0) -> Any:
    def step() -> Any:
        agent.tick()
        return cond()

    return wait_for(step, timeout=timeout, what=what)


def _workers(fake_run: FakeRun, attempt: str) -> list[dict[str, Any]]:
    return [r for r in fake_run.records("worker") if r[protocol.ENV_ATTEMPT] == attempt]


def _first_run(fake_run: FakeRun, fake: FakeSupervisor, agents: list[Agent]) -> Path:
    """Run 'run1' (uuid A) in the default state dir up to attempt 1, resuming from a
    checkpoint of its own directory; then the agent ends (a stop command).  Returns the
    state dir."""
    fake.run_uuid = "uuid-A"
    agent = _agent(agents, _config(fake_run), fake)
    state = agent.state_dir
    assert state == default_state_dir("run1", "node1")
    agent.start()
    fake.commands[1] = {"id": 1, "kind": "restart", "attempt": 1, "reason": "crash",
                        "plan": {"checkpoint": "/first/ckpt/step_50", "reason": "crash"}}
    _tick_until(agent, lambda: len(_workers(fake_run, "1")) == 2, "attempt-1 workers")
    fake.commands[2] = {"id": 2, "kind": "stop", "reason": "done",
                        "plan": {"run_status": "stopped"}}
    _tick_until(agent, lambda: agent.result == AgentExit.STOPPED, "the agent ends")
    agent.shutdown("stop command")
    agent.close()
    agents.remove(agent)
    saved = json.loads((state / "agent.json").read_text())
    assert saved["run_uuid"] == "uuid-A"
    assert saved["attempt"] == 1
    for p in fake_run.pid_dir.iterdir():
        p.unlink()
    return state


def test_the_default_state_records_the_runs_uuid_and_starts_at_its_attempt(
        xdg: Path, fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        agents: list[Agent]) -> None:
    fake_supervisor.attempt = 3  # a node joining a run that has restarted three times
    agent = _agent(agents, _config(fake_run), fake_supervisor)
    assert agent.state_dir.is_relative_to(xdg)
    agent.start()
    wait_for(lambda: len(_workers(fake_run, "3")) == 2, what="attempt-3 workers")
    assert json.loads((agent.state_dir / "agent.json").read_text())["run_uuid"] == \
        "uuid-of-run-1"
    assert agent.archived is None


def test_a_reused_name_on_a_fresh_supervisor_archives_the_old_state_before_any_worker(
        xdg: Path, fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        agents: list[Agent]) -> None:
    state = _first_run(fake_run, fake_supervisor, agents)
    # A fresh supervisor database: the name is new there, the run has another uuid.
    fresh = FakeSupervisor()
    fresh.run_uuid = "uuid-B"
    agent = _agent(agents, _config(fake_run), fresh)
    agent.start()
    wait_for(lambda: len(fake_run.records("worker")) == 2, what="workers")
    workers = fake_run.records("worker")
    assert [w[protocol.ENV_ATTEMPT] for w in workers] == ["0", "0"]  # not the old attempt 1
    assert [w[protocol.ENV_RESUME_PLAN] for w in workers] == [None, None]  # no old plan
    archived = state.with_name(f"{state.name}.archived-uuid-A")
    assert agent.archived == archived
    assert json.loads((archived / "agent.json").read_text())["run_uuid"] == "uuid-A"
    assert (archived / "plans" / "attempt-1.json").exists()
    saved = json.loads((state / "agent.json").read_text())
    assert saved["run_uuid"] == "uuid-B"
    assert saved["attempt"] == 0
    assert saved["plan"] is None
    _tick_until(agent, lambda: fresh.items("step"), "steps delivered")
    assert {b["attempt"] for b in fresh.batches.values()} == {0}
    assert fresh.seqs()[0] == 0  # a fresh spool, not the old run's sequence
    events = [e["name"] for e in fresh.items("event")]
    assert protocol.AgentEventName.STATE_ARCHIVED in events


def test_a_finished_run_is_refused_and_nothing_is_launched(
        xdg: Path, fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        agents: list[Agent], caplog: pytest.LogCaptureFixture) -> None:
    state = _first_run(fake_run, fake_supervisor, agents)
    before = (state / "agent.json").read_text()
    fake_supervisor.finished = ("run 'run1' has already completed; a finished run is not "
                                "reopened by a new agent. Start a new run under another "
                                "name (for example --run run1-2)")
    agent = Agent(_config(fake_run), transport=fake_supervisor.transport(),
                  threaded_uplink=False, echo=False)
    assert agent.run() == EXIT_REFUSED
    assert fake_run.records() == []  # no torchrun, no worker
    assert "--run run1-2" in caplog.text
    assert (state / "agent.json").read_text() == before  # the state is left alone


def test_an_old_state_without_a_uuid_is_archived(
        xdg: Path, fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        agents: list[Agent]) -> None:
    state = default_state_dir("run1", "node1")
    (state / "plans").mkdir(parents=True)
    plan = state / "plans" / "attempt-2.json"
    plan.write_text(json.dumps({"checkpoint": "/elsewhere/step_9", "attempt": 2}))
    (state / "agent.json").write_text(json.dumps({"attempt": 2, "plan": str(plan)}))
    agent = _agent(agents, _config(fake_run), fake_supervisor)
    agent.start()
    wait_for(lambda: len(fake_run.records("worker")) == 2, what="workers")
    assert {w[protocol.ENV_ATTEMPT] for w in fake_run.records("worker")} == {"0"}
    assert agent.archived is not None
    assert agent.archived.name.startswith(f"{state.name}.archived-no-uuid-")
    assert (agent.archived / "plans" / "attempt-2.json").exists()


def test_the_same_runs_state_is_kept_by_a_restarted_agent(
        xdg: Path, fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        agents: list[Agent]) -> None:
    fake_supervisor.run_uuid = "uuid-A"
    first = _agent(agents, _config(fake_run), fake_supervisor)
    first.start()
    fake_supervisor.commands[1] = {"id": 1, "kind": "restart", "attempt": 2, "plan": None}
    _tick_until(first, lambda: len(_workers(fake_run, "2")) == 2, "attempt-2 workers")
    first.launcher.stop()
    first.close()
    agents.remove(first)
    fake_supervisor.attempt = 2
    again = _agent(agents, _config(fake_run), fake_supervisor)
    again.start()
    wait_for(lambda: len(_workers(fake_run, "2")) == 4, what="attempt-2 workers again")
    assert again.archived is None


def test_a_foreign_state_found_only_once_the_supervisor_answers_is_replaced(
        xdg: Path, fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        agents: list[Agent]) -> None:
    """The supervisor is down at start: training starts from the local state (it never
    waits longer than register_wait_s); when the supervisor answers for another run, the
    workers are stopped, the state archived and attempt 0 launched afresh."""
    state = _first_run(fake_run, fake_supervisor, agents)
    fresh = FakeSupervisor()
    fresh.run_uuid = "uuid-B"
    fresh.down = "connect"
    agent = _agent(agents, _config(fake_run, register_wait_s=0.2), fresh)
    t0 = time.monotonic()
    agent.start()
    wait_for(lambda: len(_workers(fake_run, "1")) == 2, what="workers of the local attempt")
    assert time.monotonic() - t0 < 5
    fresh.down = None
    agent.uplink._next_try = 0.0  # no need to sit out the backoff
    _tick_until(agent, lambda: len(_workers(fake_run, "0")) == 2, "attempt-0 workers")
    assert agent.archived == state.with_name(f"{state.name}.archived-uuid-A")
    assert [w[protocol.ENV_RESUME_PLAN] for w in _workers(fake_run, "0")] == [None, None]
    assert fake_run.alive("worker") and all(
        w["pid"] not in fake_run.alive("worker") for w in _workers(fake_run, "1"))
    _tick_until(agent, lambda: fresh.items("step"), "steps delivered")
    assert {s["attempt"] for s in fresh.items("step")} == {0}


def _torchrun_named(fake_run: FakeRun) -> list[str]:
    """The fake torchrun behind an executable named ``torchrun``, with the rendezvous options
    of the README's two-node command: the agent rewrites it for a membership."""
    exe = fake_run.tmp_path / "bin" / "torchrun"
    exe.parent.mkdir(exist_ok=True)
    inner = fake_run.command("serve")
    exe.write_text("#!/bin/sh\nexec " + " ".join(inner[:2]) + ' "$@"\n')
    exe.chmod(0o755)
    return [str(exe), "--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d",
            "--rdzv-endpoint=127.0.0.1:29400", *inner[2:]]


def _torchruns(fake_run: FakeRun) -> list[dict[str, Any]]:
    return [r for r in fake_run.records("torchrun")]


def test_a_member_launched_before_the_supervisor_answered_is_relaunched_as_its_rank(
        xdg: Path, fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        agents: list[Agent]) -> None:
    """The supervisor is away at the start: torchrun runs as written (training never waits
    on it).  The other members run the static rendezvous the supervisor decided and would
    wait on this node for ever, so once the registration answers, this node's workers are
    relaunched as its node rank, the same attempt."""
    fake_supervisor.down = "connect"
    fake_supervisor.membership = {"role": "member", "node_rank": 1, "nnodes": 2, "epoch": 3,
                                  "endpoint": "10.0.0.5:29403", "declared": 2}
    cfg = AgentConfig(supervisor_url="http://supervisor.test", run="run1", node="node1",
                      command=_torchrun_named(fake_run), token="agent-token",
                      stop_grace_s=0.5, flush_timeout_s=2.0, register_wait_s=0.2)
    agent = _agent(agents, cfg, fake_supervisor)
    agent.start()
    first = wait_for(lambda: _torchruns(fake_run), what="torchrun as written")
    assert "--rdzv-backend=c10d" in first[0]["argv"]
    fake_supervisor.down = None
    agent.uplink._next_try = 0.0  # no need to sit out the backoff
    again = _tick_until(agent, lambda: [r for r in _torchruns(fake_run)
                                        if "--node-rank=1" in r["argv"]], "the relaunch")
    assert "--rdzv-endpoint=10.0.0.5:29403" in again[0]["argv"]
    assert again[0][protocol.ENV_ATTEMPT] == first[0][protocol.ENV_ATTEMPT]
    assert first[0]["pid"] not in fake_run.alive("torchrun")
    _tick_until(agent, lambda: [e for e in fake_supervisor.items("event")
                                if e["name"] == "membership_realigned"], "the event")


def test_a_node_the_late_registration_makes_a_spare_stops_what_it_launched(
        xdg: Path, fake_run: FakeRun, fake_supervisor: FakeSupervisor,
        agents: list[Agent]) -> None:
    fake_supervisor.down = "connect"
    fake_supervisor.membership = {"role": "spare", "node_rank": None, "nnodes": 2, "epoch": 0,
                                  "endpoint": None, "declared": 2}
    cfg = AgentConfig(supervisor_url="http://supervisor.test", run="run1", node="node1",
                      command=_torchrun_named(fake_run), token="agent-token",
                      stop_grace_s=0.5, flush_timeout_s=2.0, register_wait_s=0.2)
    agent = _agent(agents, cfg, fake_supervisor)
    agent.start()
    wait_for(lambda: fake_run.alive("worker"), what="the workers as written")
    fake_supervisor.down = None
    agent.uplink._next_try = 0.0
    _tick_until(agent, lambda: not fake_run.alive("torchrun") and not fake_run.alive("worker"),
                "the spare's workers stopped")
    (ev,) = _tick_until(agent, lambda: [e for e in fake_supervisor.items("event")
                                        if e["name"] == "membership_realigned"], "the event")
    assert ev["details"]["role"] == "spare" and agent.state == "spare"
    assert len(_torchruns(fake_run)) == 1  # nothing relaunched

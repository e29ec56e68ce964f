"""The agent driving real (fake-torchrun) process trees: launch, observe, stop, restart."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from agent_fakes import REPO, FakeRun, FakeSupervisor

from tests.waiting import wait_for
from trainwarden.agent import protocol
from trainwarden.agent.config import AgentConfig
from trainwarden.agent.core.hang import HangConfig
from trainwarden.agent.core.states import AgentExit
from trainwarden.agent.launcher import Launcher, pids_alive
from trainwarden.agent.loop import Agent, AgentAlreadyRunning


def make_agent(agents: list[Agent], cfg: AgentConfig, fake: FakeSupervisor,
               **kw: Any) -> Agent:
    agent = Agent(cfg, transport=fake.transport(), threaded_uplink=False, echo=False, **kw)
    agents.append(agent)
    return agent


def tick_until(agent: Agent, cond: Any, timeout: float = 10.0, what: str = "condition") -> Any:
    def step() -> Any:
        agent.tick()
        return cond()

    return wait_for(step, timeout=timeout, what=what)


def exits(fake: FakeSupervisor) -> list[dict[str, Any]]:
    return fake.items("exit")


# -- launcher --------------------------------------------------------------------------------


def test_stop_kills_whole_tree_including_sigterm_ignorers(fake_run: FakeRun) -> None:
    """Workers in their own sessions (as torchrun makes them) that ignore SIGTERM, with
    grandchildren: all gone after the grace, and torchrun is not waited on."""
    cfg = fake_run.config("serve", "--ignore-term", "--grandchild")
    launcher = Launcher(cfg.command, run=cfg.run, node=cfg.node, state_dir=cfg.state,
                        socket_path=cfg.socket_path, stop_grace_s=0.3, echo=False)
    cfg.state.mkdir(parents=True)
    launcher.start(0, None)
    wait_for(lambda: len(fake_run.alive("grandchild")) == 2, what="2 grandchildren")
    pids = fake_run.pids()
    assert len(pids) == 5  # torchrun, 2 workers, 2 grandchildren
    t0 = time.monotonic()
    launcher.stop()
    assert time.monotonic() - t0 < 5.0
    assert pids_alive(pids) == []
    assert launcher.find_ours() == []
    info = launcher.poll()
    assert info is not None and info.stop_requested and info.signal is not None
    assert not (cfg.state / "group.json").exists()


def test_leftovers_of_previous_agent_are_killed(fake_run: FakeRun) -> None:
    cfg = fake_run.config("serve", "--grandchild")
    cfg.state.mkdir(parents=True)
    old = Launcher(cfg.command, run=cfg.run, node=cfg.node, state_dir=cfg.state,
                   socket_path=cfg.socket_path, echo=False)
    old.start(0, None)
    wait_for(lambda: len(fake_run.alive("grandchild")) == 2, what="first tree")
    old_pids = fake_run.pids()
    # A process of another run on the same node must survive (verified by its environ).
    stranger = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env=dict(os.environ, **{protocol.ENV_RUN: "other", protocol.ENV_NODE: cfg.node,
                                protocol.ENV_AGENT_SOCKET: str(cfg.socket_path)}))
    try:
        new = Launcher(cfg.command, run=cfg.run, node=cfg.node, state_dir=cfg.state,
                       socket_path=cfg.socket_path, echo=False)
        killed = new.kill_leftovers()
        assert sorted(killed) == sorted(old_pids)
        assert pids_alive(old_pids) == []
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


# -- agent ticks -----------------------------------------------------------------------------


def test_batches_carry_steps_heartbeats_and_worker_stats(fake_run: FakeRun,
                                                         fake_supervisor: FakeSupervisor,
                                                         agents: list[Agent]) -> None:
    agent = make_agent(agents, fake_run.config("serve", "--step-s", "0.05"), fake_supervisor)
    agent.start()

    def both_ranks_seen() -> bool:
        hbs = fake_supervisor.items("heartbeat")
        return any(sorted(w["rank"] for w in hb["workers"]) == [0, 1] for hb in hbs)

    def both_ranks_stepped() -> bool:
        return {s["rank"] for s in fake_supervisor.items("step")} == {0, 1}

    tick_until(agent, both_ranks_seen, what="heartbeat with both workers")
    # A slow machine may start rank 1 a few batches after rank 0: wait for its steps too.
    tick_until(agent, both_ranks_stepped, what="steps of both ranks")
    tick_until(agent, lambda: len(fake_supervisor.seqs()) >= 3, what="3 batches")
    seqs = fake_supervisor.seqs()
    assert seqs == list(range(len(seqs)))
    for seq in seqs:
        batch = fake_supervisor.batches[seq]
        assert batch["items"][-1]["type"] == "heartbeat" and batch["attempt"] == 0
    hb = [h for h in fake_supervisor.items("heartbeat") if h["workers"]][-1]
    assert hb["state"] == "running" and hb["disk_free_bytes"] > 0
    assert all(w["rss_bytes"] > 0 and w["pid"] > 0 for w in hb["workers"])
    steps = fake_supervisor.items("step")
    assert {s["rank"] for s in steps} == {0, 1}
    for rank in (0, 1):  # nothing lost or reordered on the way
        got = [s["step"] for s in steps if s["rank"] == rank]
        assert got == list(range(len(got)))
    events = fake_supervisor.items("event")
    assert {e["rank"] for e in events if e["name"] == protocol.WorkerEventName.STARTED} == {0, 1}
    reg = fake_supervisor.registers[0]
    assert reg["run"] == "run1" and reg["node"] == "node1" and reg["command"][0] == sys.executable


@pytest.mark.parametrize(("code", "exit_code", "sig"), [(3, 3, None), (-9, None, 9)])
def test_exit_code_and_signal_reported_as_crash(fake_run: FakeRun,
                                                fake_supervisor: FakeSupervisor,
                                                agents: list[Agent], code: int,
                                                exit_code: int | None,
                                                sig: int | None) -> None:
    agent = make_agent(agents, fake_run.config("exit", "--code", str(code)), fake_supervisor)
    agent.start()
    tick_until(agent, lambda: exits(fake_supervisor), what="exit item")
    (ex,) = exits(fake_supervisor)
    assert ex["outcome"] == "crashed" and ex["exit_code"] == exit_code and ex["signal"] == sig
    assert agent.result is None  # keeps running, waiting for the supervisor
    assert fake_supervisor.items("heartbeat")[-1]["state"] == "failed"


def test_completed_run_ends_agent_with_zero(fake_run: FakeRun, fake_supervisor: FakeSupervisor,
                                            agents: list[Agent]) -> None:
    agent = make_agent(agents, fake_run.config("complete", "--steps", "3"), fake_supervisor)
    agent.start()
    tick_until(agent, lambda: agent.result == 0, what="agent result 0")
    agent.shutdown("done")
    (ex,) = exits(fake_supervisor)
    assert ex["outcome"] == "completed" and ex["exit_code"] == 0
    assert len(fake_supervisor.items("step")) == 6


def test_the_preflight_options_reach_the_workers(fake_run: FakeRun,
                                                fake_supervisor: FakeSupervisor,
                                                agents: list[Agent],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The agent's options are set in the workers' environment, over what the agent itself
    inherited; the preflight's test aid in the agent's environment reaches its workers."""
    monkeypatch.setenv(protocol.ENV_PREFLIGHT, "1")  # the config decides, not this
    monkeypatch.setenv("TRAINWARDEN_PREFLIGHT_INJECT", "fail:allreduce")
    cfg = fake_run.config("complete", "--steps", "1", preflight=False, preflight_timeout_s=2.5)
    agent = make_agent(agents, cfg, fake_supervisor)
    agent.start()
    tick_until(agent, lambda: agent.result == 0, what="agent result 0")
    agent.shutdown("done")
    workers = fake_run.records("worker")
    assert len(workers) == 2
    assert {(w[protocol.ENV_PREFLIGHT], w[protocol.ENV_PREFLIGHT_TIMEOUT],
             w["TRAINWARDEN_PREFLIGHT_INJECT"]) for w in workers} == {
        ("0", "2.5", "fail:allreduce")}


def test_crash_then_restart_command_relaunches_with_plan(fake_run: FakeRun,
                                                         fake_supervisor: FakeSupervisor,
                                                         agents: list[Agent]) -> None:
    clock_offset = [0.0]
    agent = make_agent(agents, fake_run.config("crash", "--steps", "3"), fake_supervisor,
                       clock=lambda: time.time() + clock_offset[0])
    agent.start()
    tick_until(agent, lambda: exits(fake_supervisor), what="crash exit")
    (ex,) = exits(fake_supervisor)
    assert ex["outcome"] == "crashed" and ex["exit_code"] == 1
    assert ex["failed_ranks"][0]["rank"] == 1 and ex["failed_ranks"][0]["signal"] == 9
    assert ex["failed_ranks"][0]["pid"] in fake_run.pids("worker")

    # The supervisor answers with a restart; the fake run now serves so it stays up.
    agent.launcher.command = fake_run.command("serve")
    plan = {"checkpoint": "/ckpt/step_3", "skip": [[100, 199]], "lr": None, "reason": "crash"}
    fake_supervisor.commands[11] = {"id": 11, "kind": "restart", "attempt": 1, "plan": plan,
                                    "not_before": time.time() + 3600, "reason": "crash"}
    tick_until(agent, lambda: agent.executor.job is not None
               and agent.executor.job.phase == "waiting", what="waiting for not_before")
    assert not fake_run.alive("worker") or all(
        r[protocol.ENV_ATTEMPT] == "0" for r in fake_run.records("worker"))
    clock_offset[0] = 3600.0  # the backoff is over
    tick_until(agent, lambda: [r for r in fake_run.records("worker")
                               if r[protocol.ENV_ATTEMPT] == "1"], what="attempt-1 workers")
    new = [r for r in fake_run.records("worker") if r[protocol.ENV_ATTEMPT] == "1"]
    assert new[0]["plan"]["checkpoint"] == "/ckpt/step_3"
    assert new[0]["plan"]["skip"] == [[100, 199]] and new[0]["plan"]["attempt"] == 1
    assert Path(new[0][protocol.ENV_RESUME_PLAN]).parent == agent.state_dir / "plans"
    tick_until(agent, lambda: 11 not in fake_supervisor.commands, what="command acknowledged")
    results = [(r["command_id"], r["status"]) for r in fake_supervisor.items("command_result")]
    assert results == [(11, "delivered"), (11, "done")]
    tick_until(agent, lambda: any(s["attempt"] == 1 for s in fake_supervisor.items("step")),
               what="steps of attempt 1")
    assert fake_supervisor.items("heartbeat")[-1]["attempt"] == 1
    # Each start of torchrun is an event (the end of a restart's launch phase), with its pid.
    started = [e for e in fake_supervisor.items("event")
               if e["name"] == protocol.AgentEventName.TORCHRUN_STARTED]
    assert [e["attempt"] for e in started] == [0, 1]
    assert started[1]["details"]["pid"] == agent.launcher.pid
    assert started[1]["t"] >= ex["t"]  # after the old attempt's workers were gone


def test_restart_command_stops_running_group_first(fake_run: FakeRun,
                                                   fake_supervisor: FakeSupervisor,
                                                   agents: list[Agent]) -> None:
    agent = make_agent(agents, fake_run.config("serve", "--ignore-term"), fake_supervisor)
    agent.start()
    wait_for(lambda: len(fake_run.alive("worker")) == 2, what="workers")
    first = fake_run.pids()
    fake_supervisor.commands[1] = {"id": 1, "kind": "restart", "attempt": 4, "plan": None}
    tick_until(agent, lambda: len([r for r in fake_run.records("worker")
                                   if r[protocol.ENV_ATTEMPT] == "4"]) == 2,
               what="attempt-4 workers")
    assert pids_alive(first) == []
    tick_until(agent, lambda: exits(fake_supervisor), what="exit of attempt 0")
    ex = exits(fake_supervisor)[0]
    assert ex["outcome"] == "stopped" and ex["attempt"] == 0
    # The persisted attempt is what an agent restart would launch.
    assert json.loads((agent.state_dir / "agent.json").read_text())["attempt"] == 4


@pytest.mark.parametrize(("plan", "code"), [
    ({"run_status": "stopped"}, AgentExit.STOPPED), ({"run_status": "failed"}, AgentExit.FAILED),
    ({"run_status": "completed"}, AgentExit.COMPLETED),
    (None, AgentExit.STOPPED)])  # an older supervisor's stop says nothing: no completion
def test_stop_command_ends_agent_with_the_code_of_the_runs_end(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent],
        plan: dict[str, str] | None, code: AgentExit) -> None:
    agent = make_agent(agents, fake_run.config("serve", "--grandchild"), fake_supervisor)
    agent.start()
    wait_for(lambda: len(fake_run.alive("grandchild")) == 2, what="tree up")
    pids = fake_run.pids()
    fake_supervisor.commands[3] = {"id": 3, "kind": "stop", "reason": "operator", "plan": plan}
    tick_until(agent, lambda: agent.result is not None, what="agent ends")
    assert agent.result == code
    agent.shutdown("stop command")
    assert pids_alive(pids) == []
    (ex,) = exits(fake_supervisor)
    assert ex["outcome"] == "stopped"
    results = [r["status"] for r in fake_supervisor.items("command_result")]
    assert results == ["delivered", "done"]
    assert fake_supervisor.items("heartbeat")[-1]["state"] == "stopped"


def test_training_starts_while_supervisor_down_then_replays(
        fake_run: FakeRun, http_supervisor: tuple[FakeSupervisor, str],
        agents: list[Agent]) -> None:
    """Real HTTP server: the agent launches before registering, spools while the supervisor
    answers 503, and replays everything in order once it is back."""
    fake, url = http_supervisor
    fake.down = "503"
    agent = Agent(fake_run.config("serve", url=url), threaded_uplink=True, echo=False)
    agents.append(agent)
    agent.start()
    t0 = time.monotonic()

    wait_for(lambda: agent.tick() is None and len(fake_run.alive("worker")) == 2,
             what="workers running without a supervisor")
    wait_for(lambda: agent.tick() is None and agent.uplink.pending >= 3
             and agent.receiver.received >= 12, what="3 spooled batches, 12 datagrams")
    agent.send_batch()  # spool what the last ticks collected too
    assert fake.batches == {} and agent.uplink.registration is None
    fake.down = None
    wait_for(lambda: agent.tick() is None and agent.uplink.registration is not None
             and agent.uplink.pending == 0, timeout=15, what="replay")
    assert time.monotonic() - t0 < 20
    seqs = fake.seqs()
    assert seqs == list(range(len(seqs))) and fake.duplicates == 0
    assert fake.arrivals == seqs  # in order, each once
    for rank in (0, 1):
        got = [s["step"] for s in fake.items("step") if s["rank"] == rank]
        assert got == list(range(len(got))) and len(got) > 3


def test_second_agent_on_same_state_dir_refuses(fake_run: FakeRun,
                                                fake_supervisor: FakeSupervisor,
                                                agents: list[Agent]) -> None:
    make_agent(agents, fake_run.config("serve"), fake_supervisor)
    with pytest.raises(AgentAlreadyRunning, match="state dir"):
        Agent(fake_run.config("serve"), transport=fake_supervisor.transport())


def test_command_that_cannot_start_ends_agent(fake_run: FakeRun,
                                              fake_supervisor: FakeSupervisor) -> None:
    cfg = fake_run.config("serve")
    cfg.command = [str(fake_run.tmp_path / "no-such-torchrun")]
    agent = Agent(cfg, transport=fake_supervisor.transport(), threaded_uplink=False)
    assert agent.run() == 127


# -- the agent as a process ------------------------------------------------------------------


def _agent_cmd(fake_run: FakeRun, url: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "trainwarden.agent.cli", "--supervisor", url, "--run", "run1",
            "--node", "node1", "--state-dir", str(fake_run.state_dir), "--stop-grace", "0.5",
            "--", *fake_run.command("serve", *extra)]


def _spawn_agent(fake_run: FakeRun, url: str, *extra: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, TRAINWARDEN_AGENT_TOKEN="agent-token")
    with open(fake_run.tmp_path / "agent.log", "ab") as log:  # a file: a pipe could fill up
        return subprocess.Popen(_agent_cmd(fake_run, url, *extra), cwd=REPO, env=env,
                                stdout=log, stderr=subprocess.STDOUT)


def test_sigterm_to_agent_stops_workers(fake_run: FakeRun,
                                        http_supervisor: tuple[FakeSupervisor, str]) -> None:
    fake, url = http_supervisor
    proc = _spawn_agent(fake_run, url, "--ignore-term", "--grandchild")
    try:
        wait_for(lambda: len(fake_run.alive("grandchild")) == 2, what="tree up")
        wait_for(lambda: fake.items("step"), what="steps delivered")
        pids = fake_run.pids()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
        assert pids_alive(pids) == []
        ex = fake.items("exit")
        assert len(ex) == 1 and ex[0]["outcome"] == "stopped"
        assert fake.items("heartbeat")[-1]["state"] in ("stopped", "stopping")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_restarted_agent_kills_previous_incarnation(fake_run: FakeRun,
                                                    http_supervisor: tuple[FakeSupervisor,
                                                                           str]) -> None:
    fake, url = http_supervisor
    first = _spawn_agent(fake_run, url)
    second: subprocess.Popen[bytes] | None = None
    try:
        wait_for(lambda: len(fake_run.alive("worker")) == 2, what="first workers")
        wait_for(lambda: fake.items("step"), what="first steps")
        old = fake_run.pids()
        first.kill()  # the agent dies hard; its workers (own sessions) keep running
        first.wait()
        assert len(pids_alive(old)) == 3
        seq_before = max(fake.seqs())
        second = _spawn_agent(fake_run, url)
        wait_for(lambda: len(fake_run.alive("worker")) == 2 and not pids_alive(old),
                 what="old tree gone, new workers up")
        assert len(fake_run.alive("torchrun")) == 1
        wait_for(lambda: max(fake.seqs()) > seq_before + 1, what="new batches")
        assert fake.duplicates == 0 or fake.seqs() == sorted(set(fake.seqs()))
        assert any(e.get("name") == "agent_leftovers_killed" for e in fake.items("event"))
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


# -- hangs -----------------------------------------------------------------------------------


def test_hang_restart_collects_stacks_then_kills_at_once(fake_run: FakeRun,
                                                         fake_supervisor: FakeSupervisor,
                                                         agents: list[Agent]) -> None:
    """A restart for a hang: every worker's stacks are read (rank by rank) and sent, then the
    tree is SIGKILLed at once, without the stop grace (workers ignore SIGTERM here)."""
    agent = make_agent(agents, fake_run.config("hang", "--steps", "3", "--ignore-term",
                                               stop_grace_s=600.0), fake_supervisor)
    agent.start()
    tick_until(agent, lambda: len(fake_supervisor.items("step")) == 6, what="steps, then stuck")
    pids = fake_run.pids("worker")
    fake_supervisor.commands[5] = {"id": 5, "kind": "restart", "attempt": 1, "plan": None,
                                   "reason": "hang", "collect_stacks": True}
    agent.launcher.command = fake_run.command("serve")
    tick_until(agent, lambda: pids_alive(pids) == [], what="hung workers killed")
    (stacks,) = [e for e in fake_supervisor.items("event") if e["name"] == "stacks"]
    assert sorted(stacks["details"]["stacks"]) == ["0", "1"]
    for text in stacks["details"]["stacks"].values():
        assert "stuck_in_collective" in text and "most recent call first" in text
    assert stacks["details"]["command_id"] == 5
    tick_until(agent, lambda: [r for r in fake_run.records("worker")
                               if r[protocol.ENV_ATTEMPT] == "1"], what="relaunched")


def test_local_watchdog_acts_only_while_the_supervisor_is_away(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    offset = [0.0]
    watch = HangConfig(floor_s=5.0, startup_s=60.0, warmup_s=5.0)
    agent = make_agent(agents, fake_run.config("hang", "--steps", "10", hang=watch),
                       fake_supervisor, clock=lambda: time.time() + offset[0])
    agent.start()
    tick_until(agent, lambda: len(fake_supervisor.items("step")) == 20, what="steps")
    pids = fake_run.pids("worker")
    # The supervisor answers: a stall far past the deadline is left to it.
    offset[0] = 100.0
    for _ in range(5):
        agent.tick()
    assert pids_alive(pids) == pids and not fake_supervisor.items("exit")
    # Now it is away for longer than the deadline: the agent acts on its own.
    fake_supervisor.down = "connect"
    offset[0] = 200.0
    tick_until(agent, lambda: pids_alive(pids) == [], what="local watchdog kill")
    fake_supervisor.down = None
    tick_until(agent, lambda: exits(fake_supervisor), what="exit delivered after the outage")
    (ex,) = exits(fake_supervisor)
    assert ex["outcome"] == "hung" and agent.state == "failed"
    names = [e["name"] for e in fake_supervisor.items("event")]
    assert "stacks" in names and "hang_detected_locally" in names
    local = [e for e in fake_supervisor.items("event") if e["name"] == "hang_detected_locally"]
    assert local[0]["step"] == 9 and "no step" in local[0]["message"].lower()


def test_restart_pins_its_checkpoint_and_lifts_the_previous_pin(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    """The workers keep saving and pruning until they are stopped: the checkpoint a restart
    resumes from is pinned first, so their retention cannot delete it."""
    ck = fake_run.tmp_path / "ckpt"
    for step in (50, 100):
        (ck / f"step_{step}").mkdir(parents=True)
    agent = make_agent(agents, fake_run.config("serve"), fake_supervisor)
    agent.start()
    fake_supervisor.commands[1] = {"id": 1, "kind": "restart", "attempt": 1,
                                   "plan": {"checkpoint": str(ck / "step_50")}}
    tick_until(agent, lambda: (ck / "step_50" / "PINNED").exists(), what="pin")
    tick_until(agent, lambda: 1 not in fake_supervisor.commands, what="restart done")
    fake_supervisor.commands[2] = {"id": 2, "kind": "restart", "attempt": 2,
                                   "plan": {"checkpoint": str(ck / "step_100")}}
    tick_until(agent, lambda: (ck / "step_100" / "PINNED").exists(), what="second pin")
    assert not (ck / "step_50" / "PINNED").exists()


def test_pins_follow_what_the_supervisor_protects_without_lifting_the_restart_pin(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    """The supervisor names the last good checkpoint before an open incident: it is pinned
    while named, unpinned when no longer named, and a restart's own pin stays meanwhile."""
    ck = fake_run.tmp_path / "ckpt"
    for step in (50, 100, 150):
        (ck / f"step_{step}").mkdir(parents=True)
    (ck / "step_150" / "PINNED").write_text("pinned by the user\n")
    agent = make_agent(agents, fake_run.config("serve"), fake_supervisor)
    agent.start()
    fake_supervisor.commands[1] = {"id": 1, "kind": "restart", "attempt": 1,
                                   "plan": {"checkpoint": str(ck / "step_100")}}
    tick_until(agent, lambda: (ck / "step_100" / "PINNED").exists(), what="restart pin")
    fake_supervisor.protect = [str(ck / "step_50"), str(ck / "step_100"), str(ck / "gone")]
    tick_until(agent, lambda: (ck / "step_50" / "PINNED").exists(), what="protect pin")
    assert "protected by the supervisor" in (ck / "step_50" / "PINNED").read_text()
    fake_supervisor.protect = []
    tick_until(agent, lambda: not (ck / "step_50" / "PINNED").exists(), what="unpinned")
    assert (ck / "step_100" / "PINNED").exists()  # the restart still holds it
    assert (ck / "step_150" / "PINNED").read_text() == "pinned by the user\n"
    saved = json.loads((agent.state_dir / "agent.json").read_text())
    assert saved["pins"] == {"restart": [str(ck / "step_100")]}


def test_pins_are_written_only_inside_the_checkpoint_root(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    """Paths outside --checkpoint-root (elsewhere, by ``..``, by a symlink inside the root
    that leads out) are refused, reported, and nothing is written there, by the supervisor's
    protect list or by a restart's plan."""
    ck, out = fake_run.tmp_path / "ckpt", fake_run.tmp_path / "elsewhere"
    for d in (ck / "step_50", out / "step_5", out / "step_6", out / "step_7", out / "step_9"):
        d.mkdir(parents=True)
    (ck / "step_9").symlink_to(out / "step_9")
    agent = make_agent(agents, fake_run.config("serve"), fake_supervisor)
    agent.start()
    hostile = [str(out / "step_5"), str(ck / ".." / "elsewhere" / "step_6"), str(ck / "step_9")]
    fake_supervisor.protect = [*hostile, str(ck / "step_50")]
    tick_until(agent, lambda: (ck / "step_50" / "PINNED").exists(), what="the good pin")
    fake_supervisor.commands[1] = {"id": 1, "kind": "restart", "attempt": 1,
                                   "plan": {"checkpoint": str(out / "step_7")}}
    tick_until(agent, lambda: 1 not in fake_supervisor.commands, what="restart done")

    def refused() -> set[str]:
        return {e["details"]["path"] for e in fake_supervisor.items("event")
                if e["name"] == "checkpoint_pin_refused"}

    tick_until(agent, lambda: refused() == {*hostile, str(out / "step_7")},
               what="the refusals reported")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == \
        ["step_5", "step_6", "step_7", "step_9"], "nothing written outside the root"
    assert agent.pins.refused == 4
    assert "not inside the checkpoint root" in next(
        e["message"] for e in fake_supervisor.items("event")
        if e["name"] == "checkpoint_pin_refused")


def test_without_a_checkpoint_root_pins_follow_the_workers_reported_directory(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    """The default (no --checkpoint-root): nothing is pinned until the workers report a
    checkpoint, then only inside that checkpoint's directory; the directory is remembered
    across agent restarts."""
    ck, out = fake_run.tmp_path / "ckpt", fake_run.tmp_path / "elsewhere"
    for d in (ck / "step_5", ck / "step_10", out / "step_5"):
        d.mkdir(parents=True)
    cfg = fake_run.config("serve", checkpoint_root=None)
    agent = make_agent(agents, cfg, fake_supervisor)
    agent.start()
    fake_supervisor.protect = [str(ck / "step_10"), str(out / "step_5")]
    tick_until(agent, lambda: agent.pins.refused == 2, what="refused: no root known yet")
    assert not (ck / "step_10" / "PINNED").exists()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(protocol.encode_datagram({"type": "checkpoint", "rank": 0, "step": 5,
                                           "path": str(ck / "step_5"), "t": time.time()}),
                 str(cfg.socket_path))
    tick_until(agent, lambda: (ck / "step_10" / "PINNED").exists(), what="the pin")
    assert not (out / "step_5" / "PINNED").exists()
    saved = json.loads((agent.state_dir / "agent.json").read_text())
    assert saved["checkpoint_roots"] == [str(ck)]


def test_without_a_checkpoint_root_a_restart_pins_inside_the_commands_checkpoint_dir(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    """A spare promoted to a member has run no worker, so it has learned no checkpoint
    directory: the restart's checkpoint is pinned inside the training command's
    --checkpoint-dir (the user's own word), and nothing outside it."""
    ck, out = fake_run.tmp_path / "ckpt", fake_run.tmp_path / "elsewhere"
    for d in (ck / "step_50", out / "step_5"):
        d.mkdir(parents=True)
    cfg = fake_run.config("serve", "--checkpoint-dir", str(ck), checkpoint_root=None)
    agent = make_agent(agents, cfg, fake_supervisor)
    agent.start()
    fake_supervisor.commands[1] = {"id": 1, "kind": "restart", "attempt": 1,
                                   "plan": {"checkpoint": str(ck / "step_50")}}
    tick_until(agent, lambda: (ck / "step_50" / "PINNED").exists(), what="the restart's pin")
    fake_supervisor.protect = [str(out / "step_5")]
    tick_until(agent, lambda: agent.pins.refused == 1, what="the path outside refused")
    assert not (out / "step_5" / "PINNED").exists()


def test_heartbeats_carry_disk_of_the_reported_checkpoints_and_gpu_health(
        fake_run: FakeRun, fake_supervisor: FakeSupervisor, agents: list[Agent]) -> None:
    """Without --checkpoint-root the agent measures the disk of the checkpoints the workers
    report; GPU readings ride on a heartbeat every gpu_interval_s (here NVML cannot start,
    and the heartbeat says why)."""
    ck = fake_run.tmp_path / "ckpt"
    (ck / "step_5").mkdir(parents=True)

    class NoNvml:
        def nvmlInit(self) -> None:
            raise OSError("NVML Shared Library Not Found")

    cfg = fake_run.config("serve", checkpoint_root=None, gpu_interval_s=3600.0)
    agent = make_agent(agents, cfg, fake_supervisor, gpu_module=NoNvml())
    agent.start()
    tick_until(agent, lambda: fake_supervisor.items("heartbeat"), what="a heartbeat")
    first = fake_supervisor.items("heartbeat")[0]
    assert first["disk_free_bytes"] is None and first["disk_total_bytes"] is None
    assert first["gpus"] == {"available": False,
                             "reason": "OSError: NVML Shared Library Not Found"}
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.sendto(protocol.encode_datagram({"type": "checkpoint", "rank": 0, "step": 5,
                                           "path": str(ck / "step_5"), "t": time.time()}),
                 str(cfg.socket_path))
    tick_until(agent, lambda: any(h["disk_total_bytes"] for h in
                                  fake_supervisor.items("heartbeat")), what="disk reading")
    beat = next(h for h in fake_supervisor.items("heartbeat") if h["disk_total_bytes"])
    assert 0 < beat["disk_free_bytes"] <= beat["disk_total_bytes"]
    assert "gpus" not in beat  # read once an hour here: the supervisor keeps the last one

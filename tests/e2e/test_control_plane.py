"""The control plane end to end: supervisor + agents + real torchrun, a crash brings the whole
run back from its newest complete checkpoint without a human."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from tests.e2e.system import Agent, Supervisor, ddp_script, free_rendezvous_port, wait_until
from tests.e2e.torchrun import effective_history, read_batch_logs, run_example
from trainwarden.supervisor.goodput.anatomy import PHASES

pytestmark = pytest.mark.e2e

TRAIN = ["--hidden", "32", "--seed", "5", "--checkpoint-every-steps", "50"]


def _ended(sup: Supervisor, run: str) -> dict | None:
    r = sup.get(f"/runs/{run}")
    return r if r["status"] in ("completed", "failed", "stopped") else None


def test_crash_on_rank_1_restarts_the_run_from_the_newest_checkpoint(
        supervisor: Supervisor, tmp_path: Path) -> None:
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    clean = run_example("train_ddp.py", clean_dir, "--steps", "300", *TRAIN,
                        "--checkpoint-dir", str(clean_dir / "ck"))
    assert clean.returncode == 0 and clean.summary is not None, clean.output[-3000:]

    work = tmp_path / "run"
    agent = Agent(supervisor.url, "crashy", "node0", work, [
        "--nproc_per_node=2", "--standalone", *ddp_script(
            "--steps", "300", *TRAIN, "--checkpoint-dir", str(work / "ck"),
            "--inject", "crash@230:rank=1", "--summary-json", str(work / "summary.json"),
            "--batch-log", str(work / "batches"))])
    try:
        assert agent.wait(240) == 0, agent.tail()
    finally:
        agent.stop()

    # The evaluator marks the run completed on its next tick after the agent's last batch.
    run = wait_until(lambda: _ended(supervisor, "crashy"), 15, "the run to end")
    assert run["status"] == "completed", run
    assert run["attempt"] == 1 and run["restarts"] == 1
    incidents = supervisor.get("/runs/crashy/incidents")["incidents"]
    assert len(incidents) == 1, incidents
    inc = incidents[0]
    assert inc["kind"] == "crash" and inc["rank"] == 1 and inc["node"] == "node0"
    assert inc["signal"] == 9 and inc["status"] == "resolved" and inc["attempt"] == 0
    assert inc["step"] == 230, inc  # killed in step 230, its last report step 229
    actions = supervisor.get("/runs/crashy/actions")["actions"]
    assert len(actions) == 1, actions
    act = actions[0]
    assert act["kind"] == "restart" and act["incident_id"] == inc["id"]
    assert act["actor"] == "policy" and act["status"] == "resumed"
    assert act["plan"]["checkpoint"].endswith("/step_200")  # newest complete at the crash
    assert act["resumed_step"] == 200
    assert set(act["progress"]) >= {"queued", "delivered", "restarted", "resumed"}
    # The restart's anatomy: every milestone recorded by the real agent and workers, so every
    # phase is known; none negative (the crash's workers were gone before the decision: 0);
    # together they are the decision -> first step time.
    an = supervisor.get(f"/actions/{act['id']}")["anatomy"]
    phases = an["phases_s"]
    assert sorted(phases) == sorted(PHASES)
    assert [p for p, v in phases.items() if v is None] == [], an
    assert [p for p, v in phases.items() if v < 0] == [], an
    assert an["total_s"] > 0, an
    assert sum(phases.values()) == pytest.approx(an["total_s"]), an
    assert act["anatomy"] == an  # the run's action list shows the same
    steps = {c["step"] for c in supervisor.get("/runs/crashy/checkpoints")["checkpoints"]}
    assert {200, 250, 300} <= steps

    summary = __import__("json").loads((work / "summary.json").read_text())
    assert summary["resumed_from"].endswith("step_200")
    assert summary["weights_sha256"] == clean.summary["weights_sha256"]
    logs = read_batch_logs(work / "batches")
    for rank in (0, 1):
        assert effective_history(logs[rank]) == effective_history(clean.batch_log[rank])


def test_two_nodes_restart_together_after_a_crash_on_one(
        supervisor: Supervisor, tmp_path: Path) -> None:
    port = free_rendezvous_port()
    ck = tmp_path / "ck"
    summary = tmp_path / "summary.json"
    agents = [
        Agent(supervisor.url, "twonode", f"node{n}", tmp_path / f"node{n}", [
            "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=twonode", *ddp_script(
                "--steps", "260", *TRAIN, "--checkpoint-dir", str(ck),
                "--inject", "crash@170:rank=1", "--summary-json", str(summary))])
        for n in (0, 1)]
    try:
        for a in agents:
            assert a.wait(300) == 0, a.tail()
    finally:
        for a in agents:
            a.stop()

    run = wait_until(lambda: _ended(supervisor, "twonode"), 15, "the run to end")
    assert run["status"] == "completed" and run["restarts"] == 1, run
    assert {a["node"] for a in run["agents"]} == {"node0", "node1"}
    incidents = supervisor.get("/runs/twonode/incidents")["incidents"]
    assert [i["kind"] for i in incidents] == ["crash"], incidents  # one, not one per node
    assert incidents[0]["rank"] == 1
    actions = supervisor.get("/runs/twonode/actions")["actions"]
    assert len(actions) == 1 and actions[0]["status"] == "resumed", actions
    assert actions[0]["resumed_step"] == 150
    assert __import__("json").loads(summary.read_text())["resumed_from"].endswith("step_150")


def test_supervisor_killed_mid_run_costs_training_nothing(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "supervisor").start()
    work = tmp_path / "run"
    agent = Agent(sup.url, "steady", "node0", work, [
        "--nproc_per_node=2", "--standalone", *ddp_script(
            "--steps", "1200", *TRAIN, "--step-sleep", "0.01", "--checkpoint-dir",
            str(work / "ck"), "--batch-log", str(work / "batches"))])
    try:
        wait_until(lambda: ((sup.get_or_none("/runs/steady") or {}).get("step") or 0) >= 100,
                   120, "training to be under way")
        sup.kill()
        logs = work / "batches" / "rank0.log"
        before = len(logs.read_text().splitlines())
        # Training goes on with the supervisor dead...
        wait_until(lambda: len(logs.read_text().splitlines()) >= before + 200, 120,
                   "training to progress while the supervisor is down")
        sup.start()  # ...and the agent replays what it spooled once it is back.
        assert agent.wait(240) == 0, agent.tail()
        run = wait_until(lambda: _ended(sup, "steady"), 30, "the run to end")
        assert run["status"] == "completed", run
        points = sup.get("/runs/steady/steps?max_points=5000")["points"]
        per_step = {(p["step_from"], p["step_to"]): p["ranks"] for p in points}
        # Every step of both ranks stored exactly once: nothing lost, nothing doubled.
        assert sorted(s for s, _ in per_step) == list(range(1200))
        assert set(per_step.values()) == {2}
        rows = read_batch_logs(work / "batches")
        assert [a for a, *_ in rows[0]] == ["0.0"] * 1200  # one uninterrupted attempt
        assert sup.get("/runs/steady")["restarts"] == 0
        # A clean run, even with its supervisor killed and restarted: no incident at all.
        assert sup.get("/runs/steady/incidents")["incidents"] == []
    finally:
        agent.stop()
        sup.stop()
        if agent.proc.poll() is None:
            os.kill(agent.proc.pid, signal.SIGKILL)

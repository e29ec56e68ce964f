"""The preflight under a real torchrun (gloo, 2 workers on CPU): every worker reports it
before its first step; a worker whose check fails exits non-zero before any step, its event
names the check, and its traceback reads as the machine's fault, not the script's."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.e2e.torchrun import TORCHRUN, run_example, worker_env
from tests.wire import Receiver
from trainwarden.agent.core import rootcause
from trainwarden.agent.protocol import PREFLIGHT_TIMEOUT_S, WorkerEventName

pytestmark = pytest.mark.e2e

# A worker that turns on the preflight's test aid in its own process only (the environment
# of one rank), then trains a few steps that each need both ranks.
ONE_RANK_FAILS = textwrap.dedent("""
    import os, sys
    import torch
    import torch.distributed as dist

    if os.environ["RANK"] == sys.argv[1]:
        os.environ["TRAINWARDEN_PREFLIGHT_INJECT"] = sys.argv[2]
    from trainwarden.agent.worker import init_distributed, report_step

    info = init_distributed(timeout=30)
    for step in range(3):
        t = torch.ones(1)
        dist.all_reduce(t)
        report_step(step, loss=float(t))
    dist.destroy_process_group()
""")


def test_every_worker_reports_a_passed_preflight_before_its_first_step(tmp_path: Path) -> None:
    agent = Receiver(tmp_path / "agent.sock")
    try:
        result = run_example("train_ddp.py", tmp_path, "--steps", "5", "--hidden", "16",
                             "--checkpoint-dir", str(tmp_path / "ck"),
                             env=worker_env(TRAINWARDEN_AGENT_SOCKET=agent.path,
                                            TRAINWARDEN_NODE="node0"), timeout=60)
    finally:
        agent.close()
    assert result.returncode == 0, result.output[-3000:]
    preflights = {m["rank"]: m for m in agent.of("event", WorkerEventName.PREFLIGHT)}
    assert sorted(preflights) == [0, 1], agent.of("event")
    for rank, ev in preflights.items():
        d = ev["details"]
        assert d["passed"] is True and d["failed"] is None, d
        assert 0 < d["seconds"] < PREFLIGHT_TIMEOUT_S, d
        assert d["node"] == "node0" and d["hostname"]
        assert [(c["name"], c["passed"]) for c in d["checks"]] == [
            ("devices", True), ("compute", True), ("allreduce", True)]
        assert d["checks"][2]["detail"].startswith("sum 3 across 2 ranks as expected in ")
        # Reported before the rank's first step report.
        order = [m for m in agent.messages if m["rank"] == rank]
        first_step = next(i for i, m in enumerate(order) if m["type"] == "step")
        assert order.index(ev) < first_step
    print("preflight seconds:", {r: ev["details"]["seconds"] for r, ev in preflights.items()})


def test_a_worker_that_fails_its_preflight_exits_before_any_step(tmp_path: Path) -> None:
    script = tmp_path / "one_rank_fails.py"
    script.write_text(ONE_RANK_FAILS)
    agent = Receiver(tmp_path / "agent.sock")
    try:
        proc = subprocess.run(
            [TORCHRUN, "--nproc_per_node=2", "--standalone", "--max-restarts=0",
             "--monitor-interval=0.1", str(script), "1", "fail"],
            cwd=tmp_path, env=worker_env(TRAINWARDEN_AGENT_SOCKET=agent.path),
            capture_output=True, text=True, timeout=60)
    finally:
        agent.close()
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    preflights = {m["rank"]: m["details"] for m in agent.of("event", WorkerEventName.PREFLIGHT)}
    # Rank 1 failed the compute check; rank 0, which shared the all-reduce, passed.
    assert preflights[0]["passed"] is True, preflights
    assert preflights[1]["passed"] is False
    assert preflights[1]["failed"].startswith("compute: 256x256 float32 matmul on cpu: "
                                              "largest error "), preflights[1]
    assert [c["passed"] for c in preflights[1]["checks"]] == [True, False, True]
    assert not [m for m in agent.of("step") if m["rank"] == 1]
    # The traceback the agent reads from the node's output names the failure, as the
    # machine's: a retry elsewhere may pass, unlike a bug in the script.
    rc = rootcause.from_stderr(output, rank=1, sole_failure=False)
    assert rc is not None and rc.exc_type.endswith("PreflightFailed"), output[-3000:]
    assert rc.message.startswith("preflight failed: compute: ")
    assert rootcause.classify(rc, exit_code=1) == rootcause.FailureClass.MACHINE

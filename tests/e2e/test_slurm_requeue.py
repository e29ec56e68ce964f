"""``trainwarden supervisor --fleet slurm --fleet-requeue`` against the real Slurm of
tests/slurm.py: a two-node job with no spare loses a member; the supervisor drains the dead
node and requeues the job (once Slurm confirms the job runs on the run's nodes), whose next
allocation avoids it, and the run completes as one run (the same identity, a new attempt from
the newest checkpoint) with the clean run's weights."""

from __future__ import annotations

import os
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.nodes import KILL_AT, ended, summary
from tests.e2e.system import Supervisor, wait_until
from tests.e2e.test_slurm import (
    SBATCH,
    job_ended,
    job_env,
    listens_on,
    node_processes,
    train_args,
)
from tests.e2e.torchrun import RunResult
from tests.slurm import NODES, SlurmCluster

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]  # two allocations of one job


@pytest.fixture
def resumed(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster, every node put back in service afterwards (the cluster is the session's)."""
    yield slurm
    for n in NODES:
        if "DRAIN" in slurm.node(n).get("State", ""):
            slurm.run("scontrol", "update", f"NodeName={n}", "State=RESUME")
    wait_until(lambda: slurm.states() == dict.fromkeys(NODES, "idle"), 60, "every node idle")


def test_with_no_spare_the_job_is_requeued_without_the_dead_node_and_the_run_goes_on(
        resumed: SlurmCluster, clean: RunResult, tmp_path: Path) -> None:
    slurm = resumed
    run = "slurm-requeue"
    work = tmp_path / "run"
    work.mkdir(parents=True)
    sup = Supervisor(tmp_path / "supervisor", None, "--fleet", "slurm", "--fleet-requeue",
                     env={"SLURM_CONF": str(slurm.conf)}).start()
    env = job_env(sup, run, work)
    job = slurm.sbatch("--nodes=2", "--requeue", "--gpus-per-node=0", "--cpus-per-task=1",
                       f"--output={work}/job.out", "--open-mode=append", f"--chdir={work}",
                       str(SBATCH), *train_args(work), env=env)
    try:
        def log() -> str:
            out = work / "job.out"
            return out.read_text(errors="replace")[-6000:] if out.exists() else ""

        def two_agents() -> list[dict[str, Any]] | None:
            if job_ended(slurm, job):
                raise AssertionError(f"the job ended before training:\n{log()}")
            r = sup.get_or_none(f"/runs/{run}")
            return r["agents"] if r and len(r["agents"]) == 2 and (r.get("step") or 0) >= 1 \
                else None

        agents = wait_until(two_agents, 180, "the job's two agents, training")
        first = sup.get(f"/runs/{run}")
        nodes = {a["node"] for a in agents}
        wait_until(lambda: (sup.get(f"/runs/{run}").get("step") or 0) >= KILL_AT, 120,
                   f"step {KILL_AT}")
        # The member whose torchrun does not host the first attempt's rendezvous store.
        port = int(env["RDZV_PORT"])
        victim = max(n for n in nodes if not listens_on(node_processes(run, n), port))
        for p in node_processes(run, victim):
            os.kill(p.pid, signal.SIGKILL)

        # No spare, the run may not shrink: the dead node is drained and the job requeued.
        node = wait_until(lambda: (n := slurm.node(victim)) and "DRAIN" in n["State"] and n,
                          120, f"{victim} to drain in Slurm")
        assert node["Reason"].startswith("trainwarden:"), node
        finished = wait_until(lambda: ended(sup, run), 400, "the run to end")
        assert finished["status"] == "completed", (finished, log(), sup.tail(20_000))
        end = wait_until(lambda: job_ended(slurm, job), 120, "the job to end")
        assert end["JobState"] == "COMPLETED", (end, log())
        assert end["Restarts"] == "1", end  # requeued once
        assert victim not in end["NodeList"], end  # the new allocation avoided the dead node
        # The requeue is the run's event, with the command and why; the loss was counted
        # once (node_lost), the restart on the new allocation against no budget (replace).
        events = sup.get(f"/runs/{run}/events")["events"]
        (req,) = [e for e in events if e["name"] == "requeued"]
        # (the agents hold the cluster's agent token, trusted for their hosts: the dead node
        # is drained for every job, and excluded from this one's next allocation)
        assert req["details"]["job"] == job and req["details"]["drained"] == [victim], req
        assert req["details"]["excluded"] == [victim], req
        assert [(c["command"], c["ok"]) for c in req["details"]["commands"]] == [
            (f"scontrol requeuehold {job}", True),
            (f"scontrol update JobId={job} ExcNodeList={victim}", True),
            (f"scontrol release {job}", True)], req
        assert f"without {victim} (lost" in req["message"], req
        actions = sup.get(f"/runs/{run}/actions")["actions"]
        assert [a["cause"] for a in reversed(actions)] == ["node_lost", "replace"], actions
        assert "takes node rank" in actions[0]["reason"] and victim in actions[0]["reason"]
        host = sup.get(f"/hosts/{victim}")
        assert host["state"] == "cordoned", host
        r = sup.get(f"/runs/{run}")
        assert r["restarts_by_cause"]["node_lost"] == 1
        # The wait for the new allocation is its own part of the goodput.
        assert r["goodput"]["badput_s"]["requeue"] > 0, r["goodput"]
    finally:
        slurm.run("scancel", job)
        wait_until(lambda: job_ended(slurm, job), 60, "the job to end")
        for d in Path("/tmp").glob(f"trainwarden-agent-{job}-tw*"):
            shutil.rmtree(d, ignore_errors=True)
        sup.stop()
    # One run: the same identity, a new attempt resumed from the newest checkpoint.
    assert finished["uuid"] == first["uuid"]
    assert finished["attempt"] >= 2, finished
    assert clean.summary is not None
    done = summary(work)
    assert done["weights_sha256"] == clean.summary["weights_sha256"]
    assert done["resumed_from"] is not None, done

"""trainwarden under a real Slurm (the local cluster of tests/slurm.py: three slurmd on this
machine): ``deploy/slurm/train.sbatch`` submitted as documented, real agents and torchrun."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.e2e.nodes import KILL_AT, STEPS, TRAIN, ended, summary
from tests.e2e.system import (
    AGENT_TOKEN,
    REPO,
    Supervisor,
    free_rendezvous_port,
    wait_until,
)
from tests.e2e.torchrun import EXAMPLES, RunResult, worker_env
from tests.slurm import SlurmCluster

pytestmark = pytest.mark.e2e

SBATCH = REPO / "deploy" / "slurm" / "train.sbatch"
BIN = Path(sys.executable).parent


def job_env(sup: Supervisor, run: str, work: Path, **extra: str) -> dict[str, str]:
    """The settings train.sbatch reads, as a user exports them before ``sbatch``."""
    return worker_env(
        TRAINWARDEN_SUPERVISOR=sup.url, TRAINWARDEN_AGENT_TOKEN=AGENT_TOKEN, RUN=run,
        CKPT_ROOT=str(work / "ck"), TRAINWARDEN_BIN=str(BIN / "trainwarden"),
        RDZV_PORT=str(free_rendezvous_port()),
        PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra)


def train_args(work: Path) -> list[str]:
    return [str(EXAMPLES / "train_ddp.py"), "--steps", str(STEPS), *TRAIN,
            "--summary-json", str(work / "summary.json"), "--batch-log", str(work / "batches")]


def node_processes(run: str, node: str) -> list[psutil.Process]:
    """The agent of ``run`` on Slurm node ``node`` and everything under it (torchrun, the
    workers): the node's trainwarden processes."""
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "agent" in cmd and ["--run", run] == cmd[cmd.index("--run"):cmd.index("--run") + 2] \
                and "--node" in cmd and cmd[cmd.index("--node") + 1] == node:
            return [p, *p.children(recursive=True)]
    return []


def listens_on(procs: list[psutil.Process], port: int) -> bool:
    for p in procs:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="tcp")):
                return True
        except psutil.Error:
            continue
    return False


def job_ended(slurm: SlurmCluster, job: str) -> dict[str, str] | None:
    j = slurm.job(job)
    return j if j.get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING",
                                          "COMPLETING", None) else None


def member(sup: Supervisor, run: str, node: str) -> dict[str, Any]:
    (a,) = [a for a in sup.get(f"/runs/{run}")["agents"] if a["node"] == node]
    return a


def test_the_sbatch_template_trains_two_nodes_with_a_spare_that_takes_a_dead_members_rank(
        slurm: SlurmCluster, supervisor: Supervisor, clean: RunResult, tmp_path: Path) -> None:
    """``sbatch --nodes=3 --gpus-per-node=0 --cpus-per-task=1 train.sbatch train_ddp.py ...``
    with SPARES=1: a two-node world and a spare, each agent named by its Slurm node.  A
    member's processes are SIGKILLed mid-run: the spare takes its rank, the step goes on, the
    job ends COMPLETED and the final weights are a clean two-node run's."""
    run = "slurm-template"
    work = tmp_path / "run"
    work.mkdir(parents=True)
    env = job_env(supervisor, run, work, SPARES="1")
    job = slurm.sbatch("--nodes=3", "--gpus-per-node=0", "--cpus-per-task=1",
                       f"--output={work}/job.out", f"--chdir={work}", str(SBATCH),
                       *train_args(work), env=env)
    try:
        def log() -> str:
            out = work / "job.out"
            return out.read_text(errors="replace")[-4000:] if out.exists() else ""

        def three_agents() -> list[dict[str, Any]] | None:
            if job_ended(slurm, job):
                raise AssertionError(f"the job ended before training:\n{log()}")
            r = supervisor.get_or_none(f"/runs/{run}")
            return r["agents"] if r and len(r["agents"]) == 3 and (r.get("step") or 0) >= 1 \
                else None

        agents = wait_until(three_agents, 180, "the job's three agents, training")
        roles = {a["node"]: (a["role"], a["node_rank"]) for a in agents}
        assert set(roles) == {"tw0", "tw1", "tw2"}, roles
        assert sorted(r for r in roles.values() if r[0] == "member") == [
            ("member", 0), ("member", 1)], roles
        assert roles["tw2"][0] == "spare", roles  # the allocation's last node
        r = supervisor.get(f"/runs/{run}")
        assert r["membership"]["world"] == 2, r["membership"]  # the allocation less the spare
        wait_until(lambda: (supervisor.get(f"/runs/{run}").get("step") or 0) >= KILL_AT, 120,
                   f"step {KILL_AT}")
        # The member whose torchrun does not host the first attempt's rendezvous store (the
        # agents launch the script's c10d command as it is until the membership is known,
        # and on one machine any node's torchrun may be first to bind the port; the death of
        # the store's host is another test's matter).
        members = [n for n, (role, _rank) in roles.items() if role == "member"]
        port = int(env["RDZV_PORT"])
        victim = max((n for n in members if not listens_on(node_processes(run, n), port)),
                     key=lambda n: roles[n][1])
        procs = node_processes(run, victim)
        assert len(procs) >= 3, procs  # the agent, torchrun, a worker
        for p in procs:
            os.kill(p.pid, signal.SIGKILL)

        finished = wait_until(lambda: ended(supervisor, run), 240, "the run to end")
        assert finished["status"] == "completed", finished
        end = wait_until(lambda: job_ended(slurm, job), 120, "the job to end")
        assert end["JobState"] == "COMPLETED", (end, log())
        assert end["ExitCode"] == "0:0", end
    finally:
        slurm.run("scancel", job)
        wait_until(lambda: job_ended(slurm, job), 60, "the job to end")
        # The agents' state dirs (job ids start at 1 on every new cluster).
        for d in Path("/tmp").glob(f"trainwarden-agent-{job}-tw*"):
            shutil.rmtree(d, ignore_errors=True)
    assert clean.summary is not None
    assert summary(work)["weights_sha256"] == clean.summary["weights_sha256"]
    actions = supervisor.get(f"/runs/{run}/actions")["actions"]
    assert [a["cause"] for a in actions] == ["node_lost"], actions
    assert f"tw2 takes node rank {roles[victim][1]} of {victim} (lost)" in actions[0]["reason"]
    assert member(supervisor, run, "tw2")["role"] == "member"
    assert member(supervisor, run, victim)["state"] == "replaced"

"""Nodes that die or freeze, end to end: three agents on this machine (two members and a spare,
each a node), the README's two-node torchrun command with the c10d rendezvous, the defaults a
user gets (node-lost deadline 30 s).  A node is killed by SIGKILL of its agent's whole process
tree, frozen by SIGSTOP of it."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import Agent, Supervisor, ddp_script, free_port, wait_until
from tests.e2e.torchrun import RunResult, run_example

pytestmark = pytest.mark.e2e

STEPS = 400
TRAIN = ["--hidden", "32", "--seed", "11", "--checkpoint-every-steps", "50",
         "--step-sleep", "0.02"]
KILL_AT = 120  # after the checkpoint of step 100


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "supervisor").start()
    yield sup
    sup.stop()


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The same training without a fault: two ranks, one torchrun."""
    d = tmp_path_factory.mktemp("clean")
    r = run_example("train_ddp.py", d, "--steps", str(STEPS), *TRAIN,
                    "--checkpoint-dir", str(d / "ck"))
    assert r.returncode == 0 and r.summary is not None, r.output[-3000:]
    return r


class Nodes:
    """The run's agents, started as a user starts them (the spare with --spare)."""

    def __init__(self, sup: Supervisor, run: str, work: Path) -> None:
        self.sup, self.run, self.work = sup, run, work
        self.port = free_port()
        self.agents: dict[str, Agent] = {}

    def command(self) -> list[str]:
        return ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run}",
                *ddp_script("--steps", str(STEPS), *TRAIN, "--checkpoint-dir",
                            str(self.work / "ck"), "--summary-json",
                            str(self.work / "summary.json"))]

    def start(self, node: str, *agent_args: str) -> Agent:
        a = Agent(self.sup.url, self.run, node, self.work / node, self.command(),
                  agent_args=agent_args)
        self.agents[node] = a
        return a

    def stop(self) -> None:
        for a in self.agents.values():
            a.signal_tree(signal.SIGCONT)
            a.stop()

    def step(self) -> int:
        return int((self.sup.get_or_none(f"/runs/{self.run}") or {}).get("step") or 0)

    def member(self, node: str) -> dict[str, Any]:
        (a,) = [a for a in self.sup.get(f"/runs/{self.run}")["agents"] if a["node"] == node]
        return a


def _ended(sup: Supervisor, run: str) -> dict[str, Any] | None:
    r = sup.get(f"/runs/{run}")
    return r if r["status"] in ("completed", "failed", "stopped") else None


def _summary(work: Path) -> dict[str, Any]:
    return __import__("json").loads((work / "summary.json").read_text())


def _two_members_and_a_spare(supervisor: Supervisor, tmp_path: Path, run: str) -> Nodes:
    nodes = Nodes(supervisor, run, tmp_path / "run")
    nodes.start("node0")
    nodes.start("node1")
    wait_until(lambda: nodes.step() >= 1, 120, "training to start on the two members")
    nodes.start("spare0", "--spare")
    wait_until(lambda: any(a["node"] == "spare0" for a in
                           supervisor.get(f"/runs/{run}")["agents"]), 60, "the spare to register")
    assert nodes.member("spare0")["role"] == "spare"
    assert {nodes.member(n)["node_rank"] for n in ("node0", "node1")} == {0, 1}
    return nodes


@pytest.mark.parametrize("victim", ["node1", "node0"])
def test_a_dead_member_is_replaced_by_the_spare_and_the_run_ends_as_a_clean_one(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path, victim: str) -> None:
    """(node0 holds node rank 0: it hosts the rendezvous store.)"""
    run = f"dead-{victim}"
    nodes = _two_members_and_a_spare(supervisor, tmp_path, run)
    try:
        wait_until(lambda: nodes.step() >= KILL_AT, 120, f"step {KILL_AT}")
        killed_at = time.time()
        nodes.agents[victim].signal_tree(signal.SIGKILL)
        finished = wait_until(lambda: _ended(supervisor, run), 240, "the run to end")
        assert finished["status"] == "completed", finished
        for node, a in nodes.agents.items():
            if node != victim:
                assert a.wait(60) == 0, a.tail()
    finally:
        nodes.stop()
    assert _summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    incidents = supervisor.get(f"/runs/{run}/incidents")["incidents"]
    lost = [i for i in incidents if i["kind"] == "node_lost"]
    assert [i["node"] for i in lost] == [victim], incidents
    actions = supervisor.get(f"/runs/{run}/actions")["actions"]
    replace = [a for a in actions if a["cause"] == "node_lost"]
    assert len(replace) == 1, actions
    assert replace[0]["status"] == "resumed", replace
    assert f"spare0 takes node rank {int(victim[-1])} of {victim} (lost)" in replace[0]["reason"]
    assert replace[0]["plan"]["membership"]["members"]["spare0"] == int(victim[-1])
    resumed_at = replace[0]["progress"]["resumed"]
    # From the node's death to the first resumed step: the node-lost deadline and a restart.
    assert resumed_at - killed_at < 30 + 30, replace[0]["progress"]
    assert nodes.member("spare0")["role"] == "member"
    assert nodes.member(victim)["role"] == "spare"

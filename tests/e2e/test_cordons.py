"""Bad nodes fenced off on evidence, end to end: two members and a spare (three agents on this
machine, the README's two-node command), the defaults a user gets.  A node that fails twice
with an infrastructure failure is cordoned and replaced at the second; a node whose preflight
fails is replaced before the attempt's first step; an operator cordons and uncordons through
the CLI."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.nodes import Nodes, ended, summary
from tests.e2e.system import OPERATOR_TOKEN, Supervisor, wait_until
from tests.e2e.torchrun import RunResult, worker_env

pytestmark = pytest.mark.e2e


class FaultyNodes(Nodes):
    """``Nodes`` whose training command carries extra ``--inject`` faults."""

    def __init__(self, sup: Supervisor, run: str, work: Path, inject: list[str]) -> None:
        super().__init__(sup, run, work)
        self.inject = inject

    def command(self) -> list[str]:
        cmd = super().command()
        return [*cmd, *(x for f in self.inject for x in ("--inject", f))]


def cli(sup: Supervisor, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainwarden.supervisor.cli", *args, "--supervisor", sup.url,
         "--token", OPERATOR_TOKEN], env=worker_env(), capture_output=True, text=True,
        timeout=60)


def _host(sup: Supervisor, node: str) -> dict[str, Any]:
    return dict(sup.get(f"/hosts/{node}"))


def test_a_node_that_fails_twice_on_the_machine_is_cordoned_and_replaced_at_the_second(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path) -> None:
    """Rank 1 is SIGKILLed twice (a machine's failure, not the script's); both times on the
    node holding node rank 1."""
    run = "twice"
    nodes = FaultyNodes(supervisor, run, tmp_path / "run",
                        ["crash@130:rank=1", "crash@180:rank=1"])
    nodes.start("node0")
    nodes.start("node1")
    nodes.start("spare0", "--spare")
    try:
        wait_until(lambda: nodes.step() >= 1, 120, "training to start")
        (bad,) = [n for n in ("node0", "node1") if nodes.member(n)["node_rank"] == 1]
        finished = wait_until(lambda: ended(supervisor, run), 300, "the run to end")
        assert finished["status"] == "completed", (
            finished["reason"], supervisor.get(f"/runs/{run}/incidents")["incidents"],
            supervisor.get(f"/runs/{run}/actions")["actions"])
    finally:
        nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    acts = sorted(supervisor.get(f"/runs/{run}/actions")["actions"], key=lambda a: a["id"])
    # The second failure is the evidence that cordons the node: the restart it caused is
    # decided again before it trains, with the spare in the node's rank.
    assert [a["cause"] for a in acts] == ["crash", "crash", "replace"], acts
    assert bad in acts[0]["plan"]["membership"]["members"]
    assert acts[2]["plan"]["membership"]["members"]["spare0"] == 1, acts[2]
    assert f"spare0 takes node rank 1 of {bad} (cordoned)" in acts[2]["reason"]
    assert acts[2]["status"] == "resumed", acts[2]
    host = _host(supervisor, bad)
    assert host["state"] == "cordoned", host
    assert nodes.member(bad)["role"] == "spare"


def test_a_node_whose_preflight_fails_is_replaced_before_the_first_step(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path) -> None:
    run = "preflight"
    nodes = Nodes(supervisor, run, tmp_path / "run")
    nodes.start("node0")
    wait_until(lambda: any(a["node"] == "node0" for a in
                           (supervisor.get_or_none(f"/runs/{run}") or {}).get("agents", [])),
               60, "node0 to register")
    nodes.start("node1", env={"TRAINWARDEN_PREFLIGHT_INJECT": "fail:compute"})
    nodes.start("spare0", "--spare")
    try:
        finished = wait_until(lambda: ended(supervisor, run), 300, "the run to end")
        assert finished["status"] == "completed", finished
    finally:
        nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    host = _host(supervisor, "node1")
    assert host["state"] == "cordoned", host
    events = supervisor.get(f"/runs/{run}/events")["events"]
    failed = [e for e in events if e["name"] == "preflight" and not e["details"]["passed"]]
    assert failed and all(e["attempt"] == 0 for e in failed), failed
    # node1 never trained a step: attempt 0 ended before its first step, and it was replaced
    steps0 = supervisor.get(f"/runs/{run}/steps?attempt=0")
    assert not steps0.get("points"), steps0
    assert nodes.member("node1")["role"] == "spare"
    assert nodes.member("spare0")["role"] == "member"


def test_an_operator_cordons_and_uncordons_a_node_through_the_cli(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path) -> None:
    run = "operator"
    nodes = Nodes(supervisor, run, tmp_path / "run")
    nodes.start("node0")
    nodes.start("node1")
    nodes.start("spare0", "--spare")
    try:
        wait_until(lambda: nodes.step() >= 60, 120, "step 60")
        (node,) = [n for n in ("node0", "node1") if nodes.member(n)["node_rank"] == 1]
        done = cli(supervisor, "cordon", node, "--reason", "fans failing")
        assert done.returncode == 0, done.stderr
        assert _host(supervisor, node)["state"] == "cordoned"
        # Cordoning restarts nothing; the next restart (an operator's here) replaces it.
        r = __import__("httpx").post(
            f"{supervisor.url}/api/v1/runs/{run}/restart", json={"reason": "replace it"},
            headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}, timeout=10)
        assert r.status_code == 200, r.text
        finished = wait_until(lambda: ended(supervisor, run), 300, "the run to end")
        assert finished["status"] == "completed", finished
        back = cli(supervisor, "uncordon", node, "--reason", "fans replaced")
        assert back.returncode == 0, back.stderr
        listed = cli(supervisor, "hosts")
        assert listed.returncode == 0, listed.stderr
        (row,) = [ln for ln in listed.stdout.splitlines() if ln.split()[:1] == [node]]
        assert "probation" in row, listed.stdout
    finally:
        nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    acts = sorted(supervisor.get(f"/runs/{run}/actions")["actions"], key=lambda a: a["id"])
    assert acts[-1]["actor"] == "operator"
    assert acts[-1]["plan"]["membership"]["members"]["spare0"] == 1, acts[-1]
    actions = _host(supervisor, node)["actions"]  # newest first
    assert [(a["kind"], a["actor"], a["reason"]) for a in actions] == [
        ("uncordon", "operator", "fans replaced"), ("cordon", "operator", "fans failing")]

"""What the multi-node e2e tests share: the README's two-node torchrun command run by one agent
per node on this machine (``Nodes``), the clean run they compare with, and small reads."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.netns import Fabric
from tests.e2e.system import (
    OPERATOR_TOKEN,
    REPO,
    Agent,
    Supervisor,
    free_rendezvous_port,
)
from tests.e2e.torchrun import EXAMPLES, RunResult, run_example, worker_env

STEPS = 400
TRAIN = ["--hidden", "32", "--seed", "11", "--checkpoint-every-steps", "50",
         "--step-sleep", "0.02"]
KILL_AT = 120  # after the checkpoint of step 100


class Nodes:
    """The run's agents, started as a user starts them (the spare with --spare), each running
    ``script`` (an example) with ``train``; ``env`` is added to every agent's environment."""

    def __init__(self, sup: Supervisor, run: str, work: Path, script: str = "train_ddp.py",
                 train: Sequence[str] = ("--steps", str(STEPS), *TRAIN),
                 env: dict[str, str] | None = None, fabric: Fabric | None = None,
                 nproc: int = 1) -> None:
        """``fabric``: each node's agent runs in its own network namespace of it (the
        supervisor must listen on the fabric's bridge address); ``nproc``: ranks per node."""
        self.sup, self.run, self.work, self.fabric = sup, run, work, fabric
        self.nproc = nproc
        self.script, self.train = script, list(train)
        self.env = {**(fabric.env() if fabric is not None else {}), **(env or {})}
        self.port = free_rendezvous_port()
        self.agents: dict[str, Agent] = {}

    def command(self) -> list[str]:
        return ["--nnodes=2", f"--nproc_per_node={self.nproc}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id={self.run}",
                str(EXAMPLES / self.script), *self.train, "--checkpoint-dir",
                str(self.work / "ck"), "--summary-json", str(self.work / "summary.json"),
                "--batch-log", str(self.work / "batches")]

    def start(self, node: str, *agent_args: str, env: dict[str, str] | None = None) -> Agent:
        wrap = tuple(self.fabric.wrap(node)) if self.fabric is not None else ()
        a = Agent(self.sup.url, self.run, node, self.work / node, self.command(),
                  agent_args=agent_args, env={**self.env, **(env or {})}, wrap=wrap)
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


def ended(sup: Supervisor, run: str) -> dict[str, Any] | None:
    r = sup.get(f"/runs/{run}")
    return r if r["status"] in ("completed", "failed", "stopped") else None


def cli(sup: Supervisor, *args: str) -> str:
    """``trainwarden ARGS`` against the supervisor as an operator; its output."""
    out = subprocess.run([sys.executable, "-m", "trainwarden.supervisor.cli", *args,
                          "--supervisor", sup.url, "--token", OPERATOR_TOKEN],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def summary(work: Path) -> dict[str, Any]:
    return __import__("json").loads((work / "summary.json").read_text())


def clean_ddp(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    """The same training without a fault: two ranks, one torchrun."""
    return clean_run(tmp_path_factory)


def clean_run(tmp_path_factory: pytest.TempPathFactory, script: str = "train_ddp.py",
              train: Sequence[str] = ("--steps", str(STEPS), *TRAIN),
              env: dict[str, str] | None = None) -> RunResult:
    """``Nodes``' training without a fault: the same two ranks in one torchrun (the world,
    hence the numerics, of two nodes of one rank each)."""
    d = tmp_path_factory.mktemp("clean")
    r = run_example(script, d, *train, "--checkpoint-dir", str(d / "ck"),
                    env=worker_env(**(env or {})))
    assert r.returncode == 0 and r.summary is not None, r.output[-3000:]
    return r

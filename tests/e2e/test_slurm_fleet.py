"""``trainwarden supervisor --fleet slurm`` against the real Slurm of tests/slurm.py: a cordon
drains the node in Slurm and an uncordon resumes it; an administrator's drain and a node Slurm
marks DOWN read cordoned in trainwarden with Slurm's reason, and trainwarden never lifts an
administrator's drain; a supervisor that may not run ``scontrol update`` says so and keeps
working."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.system import OPERATOR_TOKEN, Supervisor, wait_until
from tests.slurm import NODES, SlurmCluster

pytestmark = pytest.mark.e2e


@pytest.fixture
def resumed(slurm: SlurmCluster) -> Iterator[SlurmCluster]:
    """The cluster, every node put back in service afterwards (the cluster is the session's)."""
    yield slurm
    for n in NODES:
        if slurm.node(n).get("State", "") != "IDLE":
            slurm.run("scontrol", "update", f"NodeName={n}", "State=RESUME")
    wait_until(lambda: slurm.states() == dict.fromkeys(NODES, "idle"), 60, "every node idle")


def post(sup: Supervisor, path: str, reason: str) -> httpx.Response:
    return httpx.post(f"{sup.url}/api/v1{path}", json={"reason": reason}, timeout=10,
                      headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})


def host(sup: Supervisor, node: str) -> dict[str, Any]:
    """The node's ledger entry (a node without one is healthy)."""
    return sup.get_or_none(f"/hosts/{node}") or {"state": "healthy", "actions": []}


def fleet_commands(sup: Supervisor, node: str) -> list[str]:
    """The node's audited Slurm commands, oldest first."""
    return [a["reason"] for a in reversed(host(sup, node)["actions"])
            if a["kind"] == "fleet_command"]


def test_cordon_drains_uncordon_resumes_and_slurms_own_drain_or_down_reads_cordoned(
        resumed: SlurmCluster, tmp_path: Path) -> None:
    slurm = resumed
    sup = Supervisor(tmp_path / "supervisor", None, "--fleet", "slurm",
                     env={"SLURM_CONF": str(slurm.conf)}).start()
    try:
        # An operator's cordon drains the node in Slurm, with trainwarden's reason.
        assert post(sup, "/hosts/tw1/cordon", "fans failing").status_code == 200
        node = wait_until(lambda: (n := slurm.node("tw1")) and "DRAIN" in n["State"] and n,
                          30, "tw1 to drain in Slurm")
        assert node["Reason"].startswith("trainwarden: fans failing"), node
        (cmd,) = wait_until(lambda: fleet_commands(sup, "tw1"), 10, "the audited drain")
        assert "scontrol update NodeName=tw1 State=DRAIN" in cmd and "succeeded" in cmd, cmd
        # The uncordon resumes it.
        assert post(sup, "/hosts/tw1/uncordon", "fans replaced").status_code == 200
        wait_until(lambda: slurm.node("tw1")["State"] == "IDLE", 30, "tw1 to resume in Slurm")
        assert "State=RESUME" in fleet_commands(sup, "tw1")[-1]

        # An administrator's drain reads as a cordon, with Slurm's reason, within seconds...
        slurm.run("scontrol", "update", "NodeName=tw2", "State=DRAIN",
                  "Reason=maintenance window", check=True)
        h = wait_until(lambda: (h := host(sup, "tw2"))["state"] == "cordoned" and h, 15,
                       "tw2 to read cordoned")
        assert h["actor"] == "fleet" and "maintenance window" in h["reason"], h
        # ... and trainwarden never lifts it: an operator's uncordon here leaves Slurm's drain,
        # and the node reads cordoned again.
        assert post(sup, "/hosts/tw2/uncordon", "not ours to lift").status_code == 200
        wait_until(lambda: [a["kind"] for a in host(sup, "tw2")["actions"]][:3] == [
            "cordon", "uncordon", "cordon"] or None, 15, "tw2 cordoned again")  # newest first
        assert slurm.node("tw2")["Reason"].startswith("maintenance window"), slurm.node("tw2")
        assert fleet_commands(sup, "tw2") == []
        # The administrator's resume puts it back (on probation, as an uncordon does).
        slurm.run("scontrol", "update", "NodeName=tw2", "State=RESUME", check=True)
        wait_until(lambda: host(sup, "tw2")["state"] == "probation", 15, "tw2 on probation")

        # A node Slurm marks DOWN reads cordoned, with Slurm's word.
        slurm.run("scontrol", "update", "NodeName=tw0", "State=DOWN", "Reason=psu failed",
                  check=True)
        h = wait_until(lambda: (h := host(sup, "tw0"))["state"] == "cordoned" and h, 15,
                       "tw0 to read cordoned")
        assert h["reason"].startswith("slurm: down in Slurm") and "psu failed" in h["reason"]
    finally:
        sup.stop()


def test_a_supervisor_that_may_not_drain_says_so_and_keeps_its_cordons(
        resumed: SlurmCluster, tmp_path: Path) -> None:
    """``scontrol`` that reads but may not update or show the configuration (as for a user
    without Slurm's operator privilege)."""
    slurm = resumed
    fake = tmp_path / "bin"
    fake.mkdir()
    real = "/usr/bin/scontrol"
    (fake / "scontrol").write_text(
        "#!/bin/bash\n"
        f'if [ "$1 $2 $3" = "-o show node" ]; then exec {real} "$@"; fi\n'
        'echo "slurm_update error: Invalid user id" >&2\nexit 1\n')
    (fake / "scontrol").chmod(0o755)
    sup = Supervisor(tmp_path / "supervisor", None, "--fleet", "slurm",
                     env={"SLURM_CONF": str(slurm.conf),
                          "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}).start()
    try:
        def metrics() -> str:
            return httpx.get(f"{sup.url}/metrics", timeout=10,
                             headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}).text

        # At start: an error in the log, and the gauge the alert reads.
        wait_until(lambda: "cannot drain nodes" in sup.tail(100_000), 30, "the start's error")
        assert 'trainwarden_fleet_ok{backend="slurm"} 0.0' in metrics()
        # The cordon holds in trainwarden; every drain attempt is audited with its output.
        assert post(sup, "/hosts/tw1/cordon", "fans failing").status_code == 200
        (cmd,) = wait_until(lambda: fleet_commands(sup, "tw1"), 15, "the failed drain")
        assert "FAILED" in cmd and "Invalid user id" in cmd, cmd
        assert host(sup, "tw1")["state"] == "cordoned"
        assert "DRAIN" not in slurm.node("tw1")["State"]
        assert "Invalid user id" in sup.tail(100_000)
        failures = [line for line in metrics().splitlines()
                    if line.startswith("trainwarden_fleet_command_failures_total")]
        assert failures and float(failures[0].split()[-1]) >= 2, failures  # start + drain
    finally:
        sup.stop()

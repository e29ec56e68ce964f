"""Nodes that die or freeze, end to end: three agents on this machine (two members and a spare,
each a node), the README's two-node torchrun command with the c10d rendezvous, the defaults a
user gets (node-lost deadline 30 s).  A node is killed by SIGKILL of its agent's whole process
tree, frozen by SIGSTOP of it."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.nodes import KILL_AT, Nodes, cli, ended, summary
from tests.e2e.system import Supervisor, wait_until
from tests.e2e.torchrun import RunResult

pytestmark = pytest.mark.e2e

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


def test_a_clean_run_with_a_spare_every_agent_leaves_with_0_and_no_rank_is_missing_after(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path) -> None:
    """Two members and a spare that is never used.  When the run completes, the spare is
    told to stop before its credential is revoked, delivers what it spooled and exits 0, as
    the members do.  Past the node-lost deadline after the completion (every node silent),
    no rank waits for a node: not in the API, not in ``trainwarden nodes``, not in
    ``/metrics``."""
    run = "clean-spare"
    nodes = _two_members_and_a_spare(supervisor, tmp_path, run)
    try:
        finished = wait_until(lambda: ended(supervisor, run), 240, "the run to end")
        assert finished["status"] == "completed", finished
        for node, a in nodes.agents.items():
            assert a.wait(60) == 0, (node, a.tail())
    finally:
        nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    spare = nodes.agents["spare0"]
    assert "ERROR" not in spare.tail(100_000), spare.tail()
    assert list((nodes.work / "spare0" / "state-spare0" / "spool").glob("*.json")) == []
    events = supervisor.get(f"/runs/{run}/events")["events"]
    assert "credentials_revoked" not in [e["name"] for e in events]  # it left first
    wait_until(lambda: time.time() > finished["updated_at"] + 32, 60,
               "the node-lost deadline to pass after the completion", interval=1)
    r = supervisor.get(f"/runs/{run}")
    assert r["membership"]["missing"] == [], r["membership"]
    assert {a["node"]: a["state"] for a in r["agents"]} == {
        "node0": "finished", "node1": "finished", "spare0": "finished"}, r["agents"]
    metrics = __import__("httpx").get(f"{supervisor.url}/metrics", headers={
        "Authorization": "Bearer e2e-operator-token"}).text
    assert f'trainwarden_run_nodes_missing{{run="{run}"}} 0.0' in metrics
    out = cli(supervisor, "nodes", run)
    assert "waiting for a node" not in out, out


@pytest.mark.parametrize("rank", [1, 0])
def test_a_dead_member_is_replaced_by_the_spare_and_the_run_ends_as_a_clean_one(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path, rank: int) -> None:
    """The member holding node rank 1, then the one holding node rank 0 (it hosts the
    rendezvous store)."""
    run = f"dead-rank{rank}"
    nodes = _two_members_and_a_spare(supervisor, tmp_path, run)
    (victim,) = [n for n in ("node0", "node1") if nodes.member(n)["node_rank"] == rank]
    try:
        wait_until(lambda: nodes.step() >= KILL_AT, 120, f"step {KILL_AT}")
        killed_at = time.time()
        nodes.agents[victim].signal_tree(signal.SIGKILL)
        # It never reads running again: lost once its death is confirmed (its silence and the
        # survivor's failed connection), then replaced.
        gone = wait_until(lambda: (a := nodes.member(victim))["state"] in ("lost", "replaced")
                          and a, 60, "the killed node to read lost")
        assert gone["readings_stale"] is True and gone["seen_s"] >= 4.5, gone
        finished = wait_until(lambda: ended(supervisor, run), 240, "the run to end")
        assert finished["status"] == "completed", finished
        for node, a in nodes.agents.items():
            if node != victim:
                assert a.wait(60) == 0, a.tail()
    finally:
        nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    # The cause, not the symptom: one incident naming the dead node (the survivor's lost
    # connection is its consequence, never a crash of its own), confirmed before the deadline.
    incidents = supervisor.get(f"/runs/{run}/incidents")["incidents"]
    assert [(i["kind"], i["node"]) for i in incidents] == [("node_lost", victim)], incidents
    assert incidents[0]["details"]["confirmed_by"] == "peer_connection", incidents
    assert incidents[0]["opened_at"] - killed_at < 30, incidents  # before the deadline
    # One death, one restart, counted once.
    actions = supervisor.get(f"/runs/{run}/actions")["actions"]
    assert [a["cause"] for a in actions] == ["node_lost"], actions
    replace = actions
    assert {k: v for k, v in finished["restarts_by_cause"].items() if v} == {"node_lost": 1}
    assert replace[0]["status"] == "resumed", replace
    assert f"spare0 takes node rank {rank} of {victim} (lost)" in replace[0]["reason"]
    assert replace[0]["plan"]["membership"]["members"]["spare0"] == rank
    resumed_at = replace[0]["progress"]["resumed"]
    # From the node's death to the first resumed step: the node-lost deadline and a restart.
    assert resumed_at - killed_at < 30 + 30, replace[0]["progress"]
    assert nodes.member("spare0")["role"] == "member"
    assert nodes.member(victim)["role"] == "spare"
    assert nodes.member(victim)["state"] == "replaced"  # never "spare"
    rows = {line.split()[0]: line.split() for line in cli(supervisor, "nodes", run).splitlines()
            if line.startswith(("node", "spare"))}
    assert rows[victim][3] == "replaced" and rows["spare0"][3] == "finished", rows


def test_a_frozen_member_is_replaced_and_writes_nothing_when_it_wakes(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path) -> None:
    run = "frozen"
    nodes = _two_members_and_a_spare(supervisor, tmp_path, run)
    (victim,) = [n for n in ("node0", "node1") if nodes.member(n)["node_rank"] == 1]
    agent_id = nodes.member(victim)["id"]
    try:
        wait_until(lambda: nodes.step() >= KILL_AT, 120, f"step {KILL_AT}")
        frozen = nodes.agents[victim].tree()
        nodes.agents[victim].signal_tree(signal.SIGSTOP)

        def replaced() -> dict[str, Any] | None:
            acts = supervisor.get(f"/runs/{run}/actions")["actions"]
            done = [a for a in acts if a["cause"] == "node_lost" and a["status"] == "resumed"]
            return done[0] if done else None

        action = wait_until(replaced, 180, "the spare to resume in the frozen node's rank")
        assert nodes.member("spare0")["role"] == "member"
        nodes.agents[victim].signal_tree(signal.SIGCONT)
        woke = wait_until(lambda: [
            e for e in supervisor.get(f"/runs/{run}/events")["events"]
            if e["agent_id"] == agent_id and e["name"] in ("agent_woke_up", "not_a_member")],
            60, "the woken agent to report it stopped its workers")
        # Its workers are gone, its agent stays up as a spare.
        wait_until(lambda: not [p for p in frozen[1:] if p.is_running()
                                and p.status() != "zombie"], 60, "the woken workers to die")
        finished = wait_until(lambda: ended(supervisor, run), 240, "the run to end")
        assert finished["status"] == "completed", finished
        # Every agent leaves with 0, the woken node (a spare now) too: told to stop.
        for node in ("node0", "node1", "spare0"):
            assert nodes.agents[node].wait(60) == 0, nodes.agents[node].tail()
    finally:
        nodes.stop()
    assert woke, woke
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    # Nothing the woken node sent after the replacement counts: no checkpoint of its, no
    # step of the new attempts, no incident of its.
    ckpts = supervisor.get(f"/runs/{run}/checkpoints")["checkpoints"]
    assert not [c for c in ckpts if c["agent_id"] == agent_id and c["attempt"] >= 1], ckpts
    assert nodes.member(victim)["role"] == "spare"
    incidents = supervisor.get(f"/runs/{run}/incidents")["incidents"]
    assert [i["node"] for i in incidents if i["kind"] == "node_lost"] == [victim]
    assert action["plan"]["membership"]["members"]["spare0"] == 1


def test_no_spare_left_the_run_waits_without_a_restart_loop_and_a_spare_ends_the_wait(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path) -> None:
    run = "nospare"
    nodes = Nodes(supervisor, run, tmp_path / "run")
    nodes.start("node0")
    nodes.start("node1")
    try:
        wait_until(lambda: nodes.step() >= KILL_AT, 180, f"step {KILL_AT}")
        (victim,) = [n for n in ("node0", "node1") if nodes.member(n)["node_rank"] == 1]
        nodes.agents[victim].signal_tree(signal.SIGKILL)

        def waiting() -> dict[str, Any] | None:
            r = supervisor.get(f"/runs/{run}")
            return r if "no spare configured" in r["reason"] else None

        r = wait_until(waiting, 120, "the run to say it waits for node rank 1")
        assert r["status"] == "restarting" and r["membership"]["missing"] == [1], r
        (survivor,) = [n for n in ("node0", "node1") if n != victim]
        states = wait_until(lambda: (st := {a["node"]: a["state"] for a in supervisor.get(
            f"/runs/{run}")["agents"]})[survivor] == "waiting" and st, 30,
            "the survivor to read waiting")
        assert states[victim] == "lost", states
        # (no spare was ever started: the reason says so, and how to end the wait)
        assert f"node rank 1 waits for a node ({victim} lost; no spare configured)" in \
            r["reason"], r
        assert r["condition"]["state"] == "waiting", r
        assert "start `trainwarden agent --spare`" in r["condition"]["summary"], r
        metrics = __import__("httpx").get(f"{supervisor.url}/metrics", headers={
            "Authorization": "Bearer e2e-operator-token"}).text
        assert f'trainwarden_run_nodes_missing{{run="{run}"}} 1.0' in metrics
        # Watch it for two more node-lost deadlines: the lost node's silence is answered once,
        # never restarted into again.
        seen = len(supervisor.get(f"/runs/{run}/actions")["actions"])
        until = time.time() + 65

        def calm() -> bool:
            acts = supervisor.get(f"/runs/{run}/actions")["actions"]
            assert len(acts) == seen, acts
            return time.time() >= until

        wait_until(calm, 90, "two node-lost deadlines to pass", interval=2)
        assert supervisor.get(f"/runs/{run}")["status"] == "restarting"
        # A spare registers: the run restarts on it at once and ends as a clean run.
        nodes.start("spare0", "--spare")
        finished = wait_until(lambda: ended(supervisor, run), 240, "the run to end")
        assert finished["status"] == "completed", finished
    finally:
        nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    acts = sorted(supervisor.get(f"/runs/{run}/actions")["actions"], key=lambda a: a["id"])
    # One death, one restart (the survivor's lost connection confirmed it), then the wait's
    # end when the spare joins (counted against no budget).
    assert [a["cause"] for a in acts] == ["node_lost", "replace"], acts
    assert acts[-1]["status"] == "resumed", acts
    assert acts[-1]["plan"]["membership"]["members"]["spare0"] == 1, acts
    assert finished["restarts_by_cause"]["node_lost"] == 1, finished


def test_a_taken_rendezvous_port_moves_the_rendezvous_and_the_run_ends_as_a_clean_one(
        supervisor: Supervisor, clean: RunResult, tmp_path: Path) -> None:
    """Another process holds the rendezvous port on the host of node rank 0: its torchrun
    cannot listen and fails before any worker starts.  The incident says so, the restart moves
    the rendezvous to a new port with the same members, and the run ends as a clean one; the
    host is not charged with an infrastructure failure."""
    run = "porttaken"
    nodes = Nodes(supervisor, run, tmp_path / "run")
    with socket.socket() as held:
        held.bind(("127.0.0.1", nodes.port))
        held.listen()
        try:
            nodes.start("node0")
            nodes.start("node1")
            wait_until(lambda: supervisor.get_or_none(f"/runs/{run}"), 60, "the run to register")
            finished = wait_until(lambda: ended(supervisor, run), 240, "the run to end")
            assert finished["status"] == "completed", finished
        finally:
            nodes.stop()
    assert summary(nodes.work)["weights_sha256"] == clean.summary["weights_sha256"]
    (inc,) = supervisor.get(f"/runs/{run}/incidents")["incidents"]
    assert "EADDRINUSE" in inc["cause"] and f"port: {nodes.port}" in inc["cause"], inc
    host = inc["node"]
    assert f"torchrun on node {host} exited with code 1" in inc["cause"], inc
    (act,) = supervisor.get(f"/runs/{run}/actions")["actions"]
    assert "the rendezvous moves to a new port" in act["reason"], act
    assert act["plan"]["membership"]["endpoint"].endswith(f":{nodes.port + 1}"), act
    assert act["status"] == "resumed", act
    h = supervisor.get(f"/hosts/{host}")
    assert h["state"] == "healthy", h
    assert [e for e in h["evidence"] if e["kind"] == "infra_failure"] == [], h

"""Silent data corruption end to end: one bit of one parameter flipped on one replica of a
three-rank DDP run (real torchrun, gloo) is caught by the replicas' fingerprints, the
corrupt rank and its node are named, the run rolls back to the newest checkpoint the
replicas agreed on and ends with the clean run's weights, bit for bit; a node that flips
bits again is cordoned at the second corruption, and replaced by a spare (the run ends with
the clean run's weights) or, with none, the run is stopped."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.nodes import Nodes, ended
from tests.e2e.system import Agent, Supervisor, ddp_script, wait_until
from tests.e2e.torchrun import EXAMPLES, run_example
from trainwarden.agent.core.states import AgentExit

pytestmark = pytest.mark.e2e

STEPS = 450
FLIP_AT = 150  # after the optimizer step of step index 150: the checkpoint step_150 is clean
EVERY = 50  # fingerprints (and checkpoints) every 50 steps: caught at step 200
TRAIN = ["--hidden", "32", "--seed", "5", "--checkpoint-every-steps", str(EVERY),
         "--fingerprint-every", str(EVERY), "--steps", str(STEPS)]
# Paced: the rollback the supervisor decides reaches the agent a few seconds after the
# detection; unpaced, the run could end first.
PACE = ["--step-sleep", "0.02"]
SUPERVISOR_ENV = {"TRAINWARDEN_RESTART_BACKOFF_S": "0.5"}


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path_factory.mktemp("sup"), env=SUPERVISOR_ENV).start()
    yield sup
    sup.stop()


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The final weights' digest of the same run without a fault (three ranks), stopped after
    step_150 and resumed from it, as the rollback resumes: with three ranks a resumed run is
    not bit-identical to an uninterrupted one (measured: the fingerprints of a run resumed at
    step 200 equal the uninterrupted run's at 200 and differ at 250; the sum of three
    gradients is not associative), so the clean reference resumes where the rollback does."""
    work = tmp_path_factory.mktemp("clean")
    first = run_example("train_ddp.py", work, *TRAIN[:-1], str(FLIP_AT), "--checkpoint-dir",
                        str(work / "ck"), nproc=3)
    assert first.returncode == 0, first.output[-3000:]
    run = run_example("train_ddp.py", work, *TRAIN, "--checkpoint-dir", str(work / "ck"),
                      nproc=3)
    assert run.summary and run.summary["resumed_from"].endswith(f"step_{FLIP_AT}"), \
        run.output[-3000:]
    digest: str = run.summary["weights_sha256"]
    return digest


def under_trainwarden(sup: Supervisor, work: Path, name: str, *args: str,
                      node: str = "node0") -> Agent:
    return Agent(sup.url, name, node, work, [
        "--nproc_per_node=3", "--standalone", *ddp_script(
            *TRAIN, *PACE, "--checkpoint-dir", str(work / "ck"), "--summary-json",
            str(work / "summary.json"), *args)])


def finish(sup: Supervisor, agent: Agent, name: str) -> dict[str, Any]:
    try:
        assert agent.wait(300) == AgentExit.COMPLETED, agent.tail()
    finally:
        agent.stop()
    run: dict[str, Any] = wait_until(
        lambda: (r := sup.get(f"/runs/{name}"))["status"] in ("completed", "failed", "stopped")
        and r, 20, f"run {name} to end")
    return run


@pytest.mark.parametrize("bit", ["exponent", "mantissa"])
def test_a_flipped_bit_on_one_replica_is_named_and_rolled_back_to_the_clean_weights(
        supervisor: Supervisor, clean: str, tmp_path: Path, bit: str) -> None:
    """(a) an exponent bit (x2**8), (b) a low mantissa bit (a relative change of ~5e-7,
    which leaves the loss as it was): both caught at the next fingerprint check.  Each on a
    node of its own: two corruptions on one node within the window cordon it."""
    name = node = f"sdc-{bit}"
    agent = under_trainwarden(supervisor, tmp_path, name, "--inject",
                              f"bitflip@{FLIP_AT}:rank=2:bit={bit}", node=node)
    run = finish(supervisor, agent, name)
    assert run["status"] == "completed" and run["restarts"] == 1, run
    (inc,) = supervisor.get(f"/runs/{name}/incidents")["incidents"]
    assert inc["kind"] == "silent_data_corruption", inc
    assert (inc["rank"], inc["node"], inc["step"]) == (2, node, FLIP_AT + EVERY), inc
    assert "silent data corruption" in inc["cause"] and f"rank 2 on node {node}" in inc["cause"]
    assert inc["details"]["corrupt"] == [2] and inc["details"]["last_agreed_step"] == FLIP_AT
    assert inc["details"]["checkpoint"].endswith(f"step_{FLIP_AT}"), inc
    (act,) = supervisor.get(f"/runs/{name}/actions")["actions"]
    assert act["cause"] == "sdc" and act["status"] == "resumed", act
    assert act["plan"]["checkpoint"].endswith(f"step_{FLIP_AT}")
    assert act["plan"]["skip"] == [] and act["plan"]["lr"] is None  # the data is not at fault
    assert act["resumed_step"] == FLIP_AT
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{FLIP_AT}")
    assert summary["weights_sha256"] == clean  # the corruption is gone, bit for bit


def test_a_node_that_flips_bits_on_every_step_is_cordoned_after_the_second_and_the_run_stopped(
        supervisor: Supervisor, tmp_path: Path) -> None:
    """(c) Rank 2's machine flips a bit after every step from step 150 on, on every attempt
    (the persistent form of the injector, bound to the node).  The first corruption is
    rolled back; the second on the same node within the window is a persistent fault: the
    node is cordoned, and with no spare to take its place the run is stopped, failed, naming
    the cordon and the checkpoint to resume from, instead of a third rollback onto it."""
    name, node = "sdc-every-step", "flaky0"  # (its own node: the cordon is the host's)
    agent = under_trainwarden(supervisor, tmp_path, name, "--inject",
                              f"bitflip@{FLIP_AT}:len={STEPS}:rank=2:node={node}", node=node)
    try:
        assert agent.wait(300) == AgentExit.FAILED, agent.tail()
    finally:
        agent.stop()
    run = wait_until(lambda: (r := supervisor.get(f"/runs/{name}"))["status"] != "running"
                     and r, 20, f"run {name} to end")
    assert run["status"] == "failed", run
    assert (f"{node} is cordoned for silent data corruption (cordon.sdc: 2 silent data "
            "corruptions within") in run["reason"], run["reason"]
    assert "no free spare" in run["reason"] and f"step_{FLIP_AT}" in run["reason"], run
    host = supervisor.get(f"/hosts/{node}")
    assert host["state"] == "cordoned" and host["reason"].startswith("cordon.sdc: "), host
    incidents = supervisor.get(f"/runs/{name}/incidents")["incidents"]
    assert [(i["kind"], i["rank"], i["node"], i["step"]) for i in incidents] == [
        ("silent_data_corruption", 2, node, FLIP_AT + EVERY)] * 2, incidents
    acts = sorted(supervisor.get(f"/runs/{name}/actions")["actions"], key=lambda a: a["id"])
    # Rolled back once; the second rollback, decided before the cordon in the same
    # transaction, reached no agent; then the stop.
    assert [(a["kind"], a["cause"], a["status"]) for a in acts[:2]] == [
        ("restart", "sdc", "resumed"), ("restart", "sdc", "superseded")], acts
    assert [a["kind"] for a in acts[2:]] == ["stop"], acts
    assert acts[0]["plan"]["checkpoint"].endswith(f"step_{FLIP_AT}"), acts[0]


NODES_FLIP_AT = 100
NODES_TRAIN = ["--hidden", "32", "--seed", "5", "--checkpoint-every-steps", str(EVERY),
               "--fingerprint-every", str(EVERY), "--steps", "300"]


@pytest.mark.timeout(600)  # the reference run and the run under three agents
def test_a_node_that_flips_bits_again_is_cordoned_and_replaced_by_the_spare(
        supervisor: Supervisor, tmp_path: Path) -> None:
    """(d) Two nodes of two ranks each (four replicas: a majority names the corrupt one) and
    a spare.  Local rank 0 of node1 flips a bit after every step from step 100 on, on every
    attempt that runs there (the injector's persistent form, bound to the node).  The first
    corruption is rolled back; the second cordons node1 and the spare takes its node rank
    before the rollback trains; the run ends with the clean run's weights, bit for bit."""
    ref = tmp_path / "clean"
    ref.mkdir()
    for steps in (NODES_FLIP_AT, 300):  # stopped and resumed where the rollback resumes
        r = run_example("train_ddp.py", ref, *NODES_TRAIN[:-1], str(steps), "--checkpoint-dir",
                        str(ref / "ck"), nproc=4)
        assert r.returncode == 0, r.output[-3000:]
    assert r.summary and r.summary["resumed_from"].endswith(f"step_{NODES_FLIP_AT}"), r.output
    run = "sdc-nodes"
    nodes = Nodes(supervisor, run, tmp_path / "run", nproc=2, train=[
        *NODES_TRAIN, *PACE, "--inject", f"bitflip@{NODES_FLIP_AT}:len=300:rank=0:node=node1"])
    nodes.start("node0")
    nodes.start("node1")
    nodes.start("spare0", "--spare")
    try:
        wait_until(lambda: nodes.step() >= 1, 120, "training to start")
        assert nodes.member("spare0")["role"] == "spare"
        k = nodes.member("node1")["node_rank"]
        finished = wait_until(lambda: ended(supervisor, run), 400, "the run to end")
        assert finished["status"] == "completed", (
            finished["reason"], supervisor.get(f"/runs/{run}/incidents")["incidents"],
            supervisor.get(f"/runs/{run}/actions")["actions"])
    finally:
        nodes.stop()
    incidents = supervisor.get(f"/runs/{run}/incidents")["incidents"]
    assert [(i["kind"], i["rank"], i["node"], i["step"]) for i in incidents] == [
        ("silent_data_corruption", 2 * k, "node1", NODES_FLIP_AT + EVERY)] * 2, incidents
    host = supervisor.get("/hosts/node1")
    assert host["state"] == "cordoned" and host["reason"].startswith("cordon.sdc: "), host
    acts = sorted(supervisor.get(f"/runs/{run}/actions")["actions"], key=lambda a: a["id"])
    # The second corruption is the evidence that cordons node1: its rollback is decided
    # again before it trains, with the spare in node1's rank (never a third rollback).
    assert [(a["cause"], a["status"]) for a in acts] == [
        ("sdc", "resumed"), ("sdc", "superseded"), ("replace", "resumed")], acts
    assert acts[2]["plan"]["checkpoint"].endswith(f"step_{NODES_FLIP_AT}"), acts[2]
    assert acts[2]["plan"]["membership"]["members"]["spare0"] == k, acts[2]
    assert f"spare0 takes node rank {k} of node1 (cordoned for silent data corruption)" \
        in acts[2]["reason"], acts[2]
    assert nodes.member("node1")["role"] == "spare"
    summary = json.loads((nodes.work / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{NODES_FLIP_AT}")
    assert summary["weights_sha256"] == r.summary["weights_sha256"]


HSDP_FLIP_AT = 100
HSDP = ["--hidden", "32", "--seed", "5", "--checkpoint-every-steps", str(EVERY),
        "--fingerprint-every", str(EVERY), "--steps", "200", "--replicate", "2"]


@pytest.mark.timeout(600)  # two reference runs and the run under the agent
def test_hsdp_replicas_disagreeing_are_rolled_back_without_a_culprit(
        supervisor: Supervisor, tmp_path: Path) -> None:
    """(f) FSDP2 as HSDP (``--replicate 2``): the two ranks holding the same shard compare it.
    Two replicas name no culprit (no majority): the incident names both as suspects and no
    rank, and the rollback to the newest agreed checkpoint repairs the state either way.
    Plain FSDP has no replicated shard and is not covered."""
    clean_dir = tmp_path / "clean"
    clean_dir.mkdir()
    for steps in (HSDP_FLIP_AT, 200):  # stopped and resumed where the rollback resumes
        ref = run_example("train_fsdp.py", clean_dir, *HSDP[:-3], str(steps), *HSDP[-2:],
                          "--checkpoint-dir", str(clean_dir / "ck"))
        assert ref.returncode == 0, ref.output[-3000:]
    assert ref.summary is not None
    name = "sdc-hsdp"
    work = tmp_path / "tw"
    agent = Agent(supervisor.url, name, "node0", work, [
        "--nproc_per_node=2", "--standalone", str(EXAMPLES / "train_fsdp.py"), *HSDP, *PACE,
        "--checkpoint-dir", str(work / "ck"), "--summary-json", str(work / "summary.json"),
        "--inject", f"bitflip@{HSDP_FLIP_AT}:rank=1"])
    run = finish(supervisor, agent, name)
    assert run["status"] == "completed" and run["restarts"] == 1, run
    (inc,) = supervisor.get(f"/runs/{name}/incidents")["incidents"]
    assert inc["kind"] == "silent_data_corruption" and inc["rank"] is None, inc
    assert inc["step"] == HSDP_FLIP_AT + EVERY and inc["details"]["suspects"] == [0, 1], inc
    assert "no majority names the corrupt one" in inc["cause"]
    assert inc["details"]["checkpoint"].endswith(f"step_{HSDP_FLIP_AT}")
    summary = json.loads((work / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{HSDP_FLIP_AT}")
    assert summary["weights_sha256"] == ref.summary["weights_sha256"]

"""What a training command declares about its world (``trainwarden.agent.core.launch``)."""

from __future__ import annotations

import pytest

from trainwarden.agent.core.launch import (
    Membership,
    declared_nnodes,
    declared_world_size,
    endpoint,
    launcher_args,
    min_nodes_refused,
    nproc_per_node,
    rendezvous_port,
    rewrite,
    unrewritable,
)


@pytest.mark.parametrize("command, nnodes", [
    (["torchrun", "--nnodes=2", "--nproc-per-node=1", "train.py"], 2),
    (["torchrun", "--nnodes", "4", "train.py"], 4),
    (["/usr/bin/torchrun", "--nnodes=1:8", "train.py"], 8),
    (["torchrun", "--nproc-per-node", "2", "train.py"], 1),
    (["python", "-m", "torch.distributed.run", "--nnodes=3", "train.py"], 3),
    (["torchrun", "--standalone", "train.py", "--nnodes=9"], 1),  # the script's own flag
    (["torchrun", "--rdzv-endpoint", "h:1", "--nnodes=2", "t.py", "--nnodes", "7"], 2),
    (["torchrun", "--nnodes=x", "train.py"], None),
    (["python", "train.py", "--nnodes=2"], None),
    (["python", "-m", "mypkg.train", "--nnodes=2"], None),
    ([], None),
])
def test_declared_nnodes(command: list[str], nnodes: int | None) -> None:
    assert declared_nnodes(command) == nnodes


def test_launcher_args_stop_at_the_script() -> None:
    assert launcher_args(["torchrun", "--standalone", "-m", "pkg.train", "--lr", "1"]) == [
        "--standalone", "-m"]


README_CMD = ["torchrun", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
              "--rdzv-endpoint=node0.cluster:29400", "--rdzv-id=run7", "train.py",
              "--nnodes", "9", "--lr", "1"]


def test_rewrite_makes_a_static_rendezvous_at_the_membership_and_keeps_the_rest() -> None:
    m = Membership(epoch=3, nnodes=2, node_rank=1, endpoint="10.0.0.5:29403")
    assert rewrite(README_CMD, m) == [
        "torchrun", "--nnodes=2", "--node-rank=1", "--rdzv-backend=static",
        "--rdzv-endpoint=10.0.0.5:29403", "--rdzv-conf=timeout=120", "--max-restarts=0",
        "--nproc_per_node=1",
        # the script's own --nnodes is the script's
        "train.py", "--nnodes", "9", "--lr", "1"]
    spaced = ["python", "-m", "torch.distributed.run", "--standalone", "--max-restarts", "3",
              "--master_port", "1234", "--nproc-per-node", "2", "-m", "pkg.train", "--x"]
    assert rewrite(spaced, m) == [
        "python", "-m", "torch.distributed.run", "--nnodes=2", "--node-rank=1",
        "--rdzv-backend=static", "--rdzv-endpoint=10.0.0.5:29403", "--rdzv-conf=timeout=120",
        "--max-restarts=0",
        "--nproc-per-node=2", "-m", "pkg.train", "--x"]
    assert rewrite(["python", "train.py"], m) == ["python", "train.py"]  # not torchrun


def test_rendezvous_port_and_endpoint_move_with_the_epoch() -> None:
    assert rendezvous_port(README_CMD) == 29400
    assert rendezvous_port(["torchrun", "--master-port", "1234", "t.py"]) == 1234
    assert rendezvous_port(["torchrun", "--standalone", "t.py"]) == 29500
    assert endpoint("10.0.0.5", 29400, 0) == "10.0.0.5:29400"
    assert endpoint("10.0.0.5", 29400, 103) == "10.0.0.5:29403"
    assert endpoint("::1", 29400, 1) == "[::1]:29401"


@pytest.mark.parametrize(("command", "fix"), [
    (["torchrun", "--nnodes=1:4", "t.py"], "--nnodes=4"),
    (["torchrun", "--nnodes=two", "t.py"], "e.g. --nnodes=2"),
    (["torchrun", "--nnodes=2", "--rdzv-backend=etcd-v2", "t.py"], "--rdzv-backend=c10d"),
    (["torchrun", "--nnodes=2", "--rdzv-endpoint=h:65500", "t.py"], "between 1 and"),
])
def test_unrewritable_commands_name_the_fix(command: list[str], fix: str) -> None:
    why = unrewritable(command)
    assert why is not None and fix in why, why


def test_rewritable_commands() -> None:
    for cmd in (README_CMD, ["torchrun", "--nnodes=2:2", "t.py"], ["python", "t.py"],
                ["torchrun", "--standalone", "--nproc_per_node=2", "t.py"]):
        assert unrewritable(cmd) is None, cmd


def test_a_one_node_world_runs_its_command_as_it_is() -> None:
    """No rendezvous across nodes: --standalone keeps picking a free port of its own (two runs
    on one machine never meet on a fixed port)."""
    cmd = ["torchrun", "--standalone", "--nproc_per_node=2", "t.py"]
    assert rewrite(cmd, Membership(epoch=2, nnodes=1, node_rank=0, endpoint="h:1")) == cmd


def test_a_world_shrunk_to_one_node_runs_standalone_and_a_declared_one_node_world_as_is() -> None:
    shrunk = Membership(epoch=4, nnodes=1, node_rank=0, endpoint="10.0.0.5:29404", declared=2)
    assert rewrite(README_CMD, shrunk) == [
        "torchrun", "--nnodes=1", "--standalone", "--max-restarts=0", "--nproc_per_node=1",
        "train.py", "--nnodes", "9", "--lr", "1"]
    one = ["torchrun", "--standalone", "--nproc-per-node=2", "train.py"]
    assert rewrite(one, Membership(epoch=0, nnodes=1, node_rank=0, endpoint="h:1")) == one


@pytest.mark.parametrize("command, nproc", [
    (README_CMD, 1),
    (["torchrun", "--nproc-per-node", "4", "t.py", "--nproc-per-node", "9"], 4),
    (["torchrun", "--nnodes=2", "t.py"], 1),  # torchrun's default
    (["torchrun", "--nproc-per-node=gpu", "t.py"], None),
    (["python", "t.py"], None),
])
def test_nproc_per_node_is_torchruns_own(command: list[str], nproc: int | None) -> None:
    assert nproc_per_node(command) == nproc


def test_the_declared_world_in_ranks_is_the_declared_nodes_times_the_workers_per_node() -> None:
    cmd = ["torchrun", "--nnodes=3", "--nproc-per-node=2", "t.py"]
    m = Membership(epoch=1, nnodes=2, node_rank=0, endpoint="h:1", declared=3)
    assert declared_world_size(cmd, m) == 6
    assert declared_world_size(cmd, Membership(epoch=1, nnodes=3, node_rank=0,
                                               endpoint="h:1")) == 6  # an older supervisor


def test_min_nodes_must_lie_within_the_declared_world() -> None:
    assert min_nodes_refused(None, README_CMD) is None
    assert min_nodes_refused(1, README_CMD) is None
    assert min_nodes_refused(2, README_CMD) is None
    why = min_nodes_refused(3, README_CMD)
    assert why is not None and "give a number from 1 to 2" in why
    why = min_nodes_refused(0, README_CMD)
    assert why is not None and "from 1 to 2" in why
    why = min_nodes_refused(1, ["python", "train.py"])
    assert why is not None and "torchrun --nnodes=N" in why

"""What a training command declares about its world (``trainwarden.agent.core.launch``)."""

from __future__ import annotations

import pytest

from trainwarden.agent.core.launch import declared_nnodes, launcher_args


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

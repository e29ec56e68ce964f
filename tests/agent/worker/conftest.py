"""A one-process gloo group, so the Checkpointer runs for real (DCP included) in-process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.wire import Receiver
from trainwarden.agent.protocol import ENV_DECLARED_WORLD_SIZE


@pytest.fixture(autouse=True)
def full_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """A declared world in the test's own environment would change every loader's order."""
    monkeypatch.delenv(ENV_DECLARED_WORLD_SIZE, raising=False)


@pytest.fixture(scope="session")
def world1() -> None:
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[Receiver]:
    r = Receiver(tmp_path / "agent.sock")
    yield r
    r.close()

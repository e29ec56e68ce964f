"""Fixtures most end-to-end modules share: a real supervisor (SQLite, its own data directory)
per test, and a clean two-node DDP run per module, the reference every faulted run's final
weights are compared with."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.nodes import clean_ddp
from tests.e2e.system import Supervisor
from tests.e2e.torchrun import RunResult


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path / "supervisor").start()
    yield sup
    sup.stop()


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> RunResult:
    return clean_ddp(tmp_path_factory)

"""Shared test configuration."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.slurm import SlurmCluster
from tests.slurm import cluster as slurm_cluster
from tests.slurm import missing as slurm_missing

REPO = Path(__file__).resolve().parents[1]
POSTGRES_ENV = "TRAINWARDEN_TEST_POSTGRES_URL"

# `make test` runs the suite as two pytest processes side by side (tests/parallel.py), one per
# core, each taking one shard: the end-to-end tests that start torchrun, one after the other,
# and everything else beside them (unit and API tests, the browser, packaging, and the
# end-to-end modules that run one torchrun job at a time and assert no timing: exact resume,
# the framework integrations, the worker-level elastic runs, the preflight, the demo, a full
# checkpoint disk, root causes, run identity, the live dashboard).  Much of an
# end-to-end test's time is waiting (deadlines, step sleeps, process start-up), which the
# other shard uses.  TRAINWARDEN_TEST_SHARD selects a shard; unset, every test runs.
SHARD_ENV = "TRAINWARDEN_TEST_SHARD"
SHARDS = ("e2e", "rest")
E2E = REPO / "tests" / "e2e"
BESIDE_E2E = {"test_frameworks.py", "test_resume.py", "test_resume_plan.py",
              "test_elastic_worker.py", "test_lightning_elastic.py", "test_lightning_docs.py",
              "test_preflight.py", "test_demo.py", "test_disk_full.py", "test_root_cause.py",
              "test_run_identity.py", "test_dashboard_live.py"}


def shard_of(path: Path) -> str:
    return "e2e" if path.parent == E2E and path.name not in BESIDE_E2E else "rest"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = os.environ.get(SHARD_ENV)
    if not shard:
        return
    if shard not in SHARDS:
        raise pytest.UsageError(f"{SHARD_ENV}={shard!r}: use one of {', '.join(SHARDS)}")
    keep = [i for i in items if shard_of(Path(str(i.path))) == shard]
    kept = set(keep)
    config.hook.pytest_deselected(items=[i for i in items if i not in kept])
    items[:] = keep


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def python_exe() -> str:
    return sys.executable


@pytest.fixture(scope="session")
def postgres_url() -> str:
    """URL of a real PostgreSQL (set by .ci/run); tests that need it skip without it."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        pytest.skip(f"{POSTGRES_ENV} is not set: no PostgreSQL to test against")
    return url



@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A real Slurm cluster of three nodes on this machine (tests/slurm.py), for the session;
    the tests that take it skip, saying why, where Slurm is not installed or not root."""
    why = slurm_missing()
    if why:
        pytest.skip(why)
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c

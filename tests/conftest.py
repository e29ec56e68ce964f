"""Shared test configuration."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
POSTGRES_ENV = "TRAINWARDEN_TEST_POSTGRES_URL"


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

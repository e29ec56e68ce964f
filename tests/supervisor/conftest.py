"""Fixtures for the supervisor tests: a store on SQLite and on Postgres, an app, a clock."""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database, make_database
from trainwarden.supervisor.store.models import metadata

# The helpers are a plain module beside this file (tests/supervisor is not a package: a
# package named "supervisor" here would shadow the real one).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tests.supervisor.sup_helpers import FakeClock, make_settings, schema_url

BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(scope="session")
def pg_schema(postgres_url: str) -> Iterator[str]:
    """A fresh schema for this test session (parallel sessions do not collide)."""
    name = f"tw_test_{uuid.uuid4().hex[:10]}"
    eng = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f"CREATE SCHEMA {name}"))
    try:
        yield name
    finally:
        with eng.connect() as c:
            c.execute(text(f"DROP SCHEMA {name} CASCADE"))
        eng.dispose()


@pytest.fixture(scope="session")
def pg_tables_url(postgres_url: str, pg_schema: str) -> str:
    """URL of the session schema, with the tables created once."""
    url = schema_url(postgres_url, pg_schema)
    eng = create_engine(url)
    metadata.create_all(eng)
    eng.dispose()
    return url


@pytest.fixture(params=BACKENDS)
def db(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Database]:
    """An empty store with the current schema, on each backend."""
    if request.param == "sqlite":
        database = make_database(f"sqlite:///{tmp_path / 'test.db'}", pool_size=4)
        metadata.create_all(database.engine)
    else:
        url = request.getfixturevalue("pg_tables_url")
        database = make_database(url, pool_size=4)
        names = ", ".join(t.name for t in metadata.sorted_tables)
        with database.engine.begin() as c:
            c.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    try:
        yield database
    finally:
        database.dispose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def settings() -> SupervisorSettings:
    return make_settings()


@pytest.fixture
def app(settings: SupervisorSettings, db: Database, clock: FakeClock) -> FastAPI:
    return create_app(settings, db=db, clock=clock, upgrade_schema=False, start_evaluator=False)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def evaluator(app: FastAPI) -> Evaluator:
    ev: Evaluator = app.state.evaluator
    return ev

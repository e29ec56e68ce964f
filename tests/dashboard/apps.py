"""Fixtures for the dashboard and metrics tests: the real app on a temporary SQLite store
with an injected clock (the evaluator is driven by hand)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.dashboard.synth import AGENT_TOKEN, OPERATOR_TOKEN
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database, make_database
from trainwarden.supervisor.store.models import metadata

T0 = 1_700_000_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def settings(**kw: Any) -> SupervisorSettings:
    base: dict[str, Any] = {"agent_token": AGENT_TOKEN, "operator_token": OPERATOR_TOKEN,
                            "restart_budget": 3, "restart_backoff_s": 0.0,
                            "restart_backoff_max_s": 0.0}
    base.update(kw)
    return SupervisorSettings(**base)


def sqlite_db(path: Path) -> Database:
    db = make_database(f"sqlite:///{path}", pool_size=4)
    metadata.create_all(db.engine)
    return db


def build_app(db: Database, clock: FakeClock, **kw: Any) -> FastAPI:
    return create_app(settings(**kw), db=db, clock=clock, upgrade_schema=False,
                      start_evaluator=False)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Database]:
    database = sqlite_db(tmp_path / "tw.db")
    try:
        yield database
    finally:
        database.dispose()


@pytest.fixture
def app(db: Database, clock: FakeClock) -> FastAPI:
    return build_app(db, clock)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


@pytest.fixture
def evaluator(app: FastAPI) -> Evaluator:
    ev: Evaluator = app.state.evaluator
    return ev

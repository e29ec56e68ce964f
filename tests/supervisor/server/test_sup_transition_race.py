"""An operator's stop that loses a race with another writer (the evaluator ending the run
between the route's read and its write, on another connection or another replica) is told
so: a 409 naming the run's status, nothing written, never a 500."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select, update

from tests.supervisor.sup_helpers import OPERATOR, register
from trainwarden.supervisor.api import runs
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.store import tables
from trainwarden.supervisor.store.db import Database


def _end(db: Database, run: str) -> None:
    """Another writer completes the run and commits."""
    with db.write() as c:
        c.execute(update(tables.runs).where(tables.runs.c.name == run)
                  .values(status="completed", reason="every agent completed"))


def _stop_after(monkeypatch: pytest.MonkeyPatch, before_decision: Any) -> None:
    real = policy.operator_stop

    def stop(*a: Any, **kw: Any) -> Any:
        before_decision()
        return real(*a, **kw)
    monkeypatch.setattr(runs.policy, "operator_stop", stop)


def _assert_refused_and_nothing_written(client: TestClient, db: Database) -> None:
    r = client.post("/api/v1/runs/r1/stop", json={"reason": "operator"}, headers=OPERATOR)
    assert r.status_code == 409, r.text
    assert r.json()["detail"].startswith("nothing done: "), r.json()
    assert "is completed: it may not become stopped" in r.json()["detail"], r.json()
    with db.read() as c:
        row = c.execute(select(tables.runs.c.status, tables.runs.c.reason)
                        .where(tables.runs.c.name == "r1")).one()
        assert tuple(row) == ("completed", "every agent completed")
        assert c.execute(select(tables.actions.c.id)).all() == []
        assert c.execute(select(tables.commands.c.id)).all() == []


def test_a_stop_that_read_a_run_another_writer_ended_is_refused_with_409(
        client: TestClient, db: Database, monkeypatch: pytest.MonkeyPatch) -> None:
    """The route read the run while it ran; the other writer's commit lands before the
    route's write (a stale read on SQLite; a real second connection on Postgres)."""
    register(client, node="n0")
    register(client, node="n1")
    if db.is_sqlite:  # one writer at a time: the route's read is made stale instead
        _end(db, "r1")
        real = runs._run_or_404
        monkeypatch.setattr(runs, "_run_or_404",
                            lambda conn, name: {**real(conn, name), "status": "running"})
    else:
        _stop_after(monkeypatch, lambda: _end(db, "r1"))
    _assert_refused_and_nothing_written(client, db)


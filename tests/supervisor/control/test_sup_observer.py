"""The detectors in a process of their own (``ObserverProcess``, what the supervisor runs
by default) find what the in-thread ``Observer`` finds on the same store, keep their state
between ticks, and a child that dies is replaced."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import FakeClock, ingest, make_settings, register, step
from trainwarden.supervisor.control.observer import (
    Observer,
    ObserveRequest,
    ObserverProcess,
    can_run_apart,
)
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database


@pytest.fixture
def client(db: Database, clock: FakeClock) -> Iterator[TestClient]:
    settings = make_settings(hang_floor_s=5.0, hang_warmup_s=20.0, node_lost_s=10.0)
    app = create_app(settings, db=db, clock=clock, upgrade_schema=False,
                     start_evaluator=False)
    with TestClient(app) as c:
        yield c


def test_the_observer_process_finds_what_the_thread_finds(
        client: TestClient, clock: FakeClock, db: Database) -> None:
    detection = client.app.state.evaluator.detection  # type: ignore[attr-defined]
    agent = register(client, node="n0")["agent_id"]
    for s in range(40):  # rank 1 is 3x slower than rank 0: a straggler
        clock.advance(0.5)
        ingest(client, agent, s, [
            step(r, s, t=clock.now, world_size=2, data_s=0.01, compute_s=0.2 * (1 + 2 * r),
                 loss=1.0 / (1 + 0.01 * s))
            for r in (0, 1)])
    thread, proc = Observer(detection), ObserverProcess(db.url, detection, timeout_s=60)
    try:
        for wait in (0.0, 60.0):  # then the node goes silent: lost
            req = ObserveRequest(now=clock.now + wait, observing_since=0.0, held=False,
                                 batch_interval_s=None)
            here, there = thread.observe(db, req), proc.observe(db, req)
            assert there is not None
            assert there == here
        kinds = {f.kind for obs in here.values() for f in obs.findings}
        assert kinds == {"node_lost", "straggler"}, kinds
        proc._proc.kill()  # the child dies: that tick has no observations ...
        proc._proc.join(10)
        assert proc.observe(db, req) is None
        # ... then a new one, with a state of its own as a new observer in the thread has
        assert proc.observe(db, req) == Observer(detection).observe(db, req)
    finally:
        proc.close()


def test_an_in_memory_database_keeps_the_detectors_in_the_thread() -> None:
    assert can_run_apart("sqlite:////var/lib/trainwarden/trainwarden.db")
    assert can_run_apart("postgresql+psycopg://u@db/trainwarden")
    assert not can_run_apart("sqlite://")
    assert not can_run_apart("sqlite:///:memory:")

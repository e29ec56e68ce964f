"""An app driven by a clock of its own (the tests' fake wall clock) lives in that clock's
time: a stall of the real machine (here the app's event loop blocked for seconds) is not an
overload of that world, and no verdict of the fake world is held back by it.  The sibling: an
app on the real clock (the default) judges its real event loop.  (A real supervisor process
frozen under load: ``tests/supervisor/ingest/test_sup_overload.py``.)"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import make_settings
from tests.waiting import wait_for
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database

STALL_S = 2.5  # > overload.loop_lag_s (2 s)


@contextlib.contextmanager
def event_loop_blocked(client: TestClient) -> Iterator[None]:
    """The app's event loop blocked (a synchronous wait inside a task) for at least
    ``STALL_S`` of real time, until the block ends."""
    portal = client.portal
    assert portal is not None
    started, release = threading.Event(), threading.Event()

    async def block() -> None:
        started.set()
        release.wait(30)  # blocks the loop itself, not only this task

    future = portal.start_task_soon(block)
    try:
        assert started.wait(10), "the blocking task never ran"
        since = time.monotonic()
        wait_for(lambda: time.monotonic() - since > STALL_S, 10, "the stall to last")
        yield
    finally:
        release.set()
        future.result(30)


def _first_beat(client: TestClient, app: FastAPI) -> None:
    """The app's event loop has run its lag watch once (before that it reports nothing)."""
    wait_for(lambda: client.portal is not None
             and app.state.delivery.report(time.time()).loop_silent_s is not None, 10,
             "the event loop's first beat")


def test_a_real_stall_is_no_overload_of_a_fake_clock_world(
        app: FastAPI, client: TestClient, evaluator: Evaluator) -> None:
    _first_beat(client, app)
    evaluator.tick()
    with event_loop_blocked(client):
        evaluator.tick()
        assert evaluator.overload is None, evaluator.overload


def test_an_app_on_the_real_clock_judges_its_real_event_loop(db: Database, app: FastAPI
                                                             ) -> None:
    real = create_app(make_settings(), db=db, upgrade_schema=False, start_evaluator=False)
    ev: Evaluator = real.state.evaluator
    with TestClient(real) as c:
        _first_beat(c, real)
        ev.tick()
        with event_loop_blocked(c):
            ev.tick()
            assert ev.overload is not None, "a blocked event loop read as keeping up"
            assert "the event loop has not run for" in ev.overload.reason, ev.overload

"""An agent that knows several supervisor addresses: the real ``Uplink``
against two real supervisor processes sharing one Postgres.  The first is killed; the batches
spooled meanwhile go to the second, in order, under the same registration and credential,
each stored once.  And against a real supervisor beside an address that answers 503 (moved
on at once) or 500 (not moved on: that may be the batch's fault)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.dashboard.browser import serve_in_thread
from tests.e2e.system import AGENT_TOKEN, Supervisor, postgres_schema, wait_until
from trainwarden.agent.uplink import Uplink
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.server.app import create_app

RUN = "failover"


@pytest.fixture
def replicas(tmp_path: Path, postgres_url: str) -> Iterator[tuple[Supervisor, Supervisor]]:
    with postgres_schema(postgres_url) as url:
        made = [Supervisor(tmp_path / name, None, "--db", url) for name in ("a", "b")]
        try:
            for sup in made:  # one after the other: the first creates the schema
                sup.start()
            yield made[0], made[1]
        finally:
            for sup in made:
                sup.stop()


def _enqueue(up: Uplink, step: int) -> None:
    up.enqueue([{"type": "step", "attempt": 0, "rank": 0, "world_size": 1, "step": step,
                 "t": time.time(), "loss": 1.0}],
               {"type": "heartbeat", "t": time.time(), "attempt": 0, "state": "running"},
               attempt=0)


def _deliver(up: Uplink) -> bool:
    up._next_try = 0.0  # no backoff wait in tests
    up.pump()
    return up.pending == 0


def _stored_steps(sup: Supervisor) -> list[int]:
    points = sup.get(f"/runs/{RUN}/steps?max_points=5000")["points"]
    return [p["step_from"] for p in points for _ in range(p["ranks"])]


def test_the_uplink_fails_over_to_the_next_replica_and_keeps_its_spool_order(
        tmp_path: Path, replicas: tuple[Supervisor, Supervisor]) -> None:
    a, b = replicas
    state = tmp_path / "agent"
    state.mkdir()
    up = Uplink(supervisor_url=f"{a.url},{b.url}", token=AGENT_TOKEN, state_dir=state,
                register_request={"run": RUN, "node": "n0", "hostname": "h0"})
    try:
        for s in range(5):
            _enqueue(up, s)
        assert _deliver(up)
        assert up.supervisor_url == a.url
        agent_id, credential = up.agent_id, up.credential
        a.kill()
        for s in range(5, 10):  # spooled while the first replica is dead
            _enqueue(up, s)
        wait_until(lambda: _deliver(up), 30, "the spooled batches to reach the second replica")
        assert up.supervisor_url == b.url
        # The same agent and credential: the registration lives in the shared store.
        assert (up.agent_id, up.credential) == (agent_id, credential)
        # Every step stored exactly once, none lost on the way.
        assert _stored_steps(b) == list(range(10))
    finally:
        up.close()


def test_the_uplink_comes_back_to_the_first_address_when_the_second_fails(
        tmp_path: Path, replicas: tuple[Supervisor, Supervisor]) -> None:
    a, b = replicas
    state = tmp_path / "agent"
    state.mkdir()
    # The second address first: killing it sends the uplink round to the first.
    up = Uplink(supervisor_url=[b.url, a.url], token=AGENT_TOKEN, state_dir=state,
                register_request={"run": RUN, "node": "n0", "hostname": "h0"})
    try:
        _enqueue(up, 0)
        assert _deliver(up)
        b.kill()
        _enqueue(up, 1)
        wait_until(lambda: _deliver(up), 30, "the batch to reach the other replica")
        assert up.supervisor_url == a.url
        assert _stored_steps(a) == [0, 1]
    finally:
        up.close()


@pytest.fixture
def real(tmp_path: Path) -> Iterator[str]:
    """A real supervisor (uvicorn in a thread, SQLite)."""
    settings = SupervisorSettings(agent_token=AGENT_TOKEN, operator_token="operator-secret",
                                  data_dir=tmp_path / "sup")
    (tmp_path / "sup").mkdir()
    with serve_in_thread(create_app(settings, start_evaluator=False)) as base:
        yield base


def _answering(code: int) -> Iterator[str]:
    class Answer(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def unavailable() -> Iterator[str]:
    yield from _answering(503)


@pytest.fixture
def broken() -> Iterator[str]:
    yield from _answering(500)


def test_a_503_moves_the_uplink_to_the_next_address_at_once(
        tmp_path: Path, real: str, unavailable: str) -> None:
    up = Uplink(supervisor_url=[unavailable, real], token=AGENT_TOKEN, state_dir=tmp_path,
                register_request={"run": RUN, "node": "n0", "hostname": "h0"})
    try:
        _enqueue(up, 0)
        up.pump()  # the registration is answered 503: on to the next address, no backoff
        assert up.supervisor_url == real
        assert up._next_try == 0.0
        assert _deliver(up)
    finally:
        up.close()


def test_a_500_is_not_a_reason_to_leave_the_address(tmp_path: Path, real: str,
                                                     broken: str) -> None:
    up = Uplink(supervisor_url=[broken, real], token=AGENT_TOKEN, state_dir=tmp_path,
                register_request={"run": RUN, "node": "n0", "hostname": "h0"})
    try:
        _enqueue(up, 0)
        up.pump()  # answered 500: retried at this address with backoff
        assert up.supervisor_url == broken
        assert up.pending == 1
    finally:
        up.close()

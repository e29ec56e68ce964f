"""Fixtures for the agent tests (the doubles themselves live in agent_fakes.py)."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

# The test doubles are a plain module beside this file (tests/agent is not a package: a
# package named "agent" here would shadow the real one).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_fakes import (
    AGENT_TOKEN,
    OPERATOR_TOKEN,
    FakeRun,
    FakeSupervisor,
    SupervisorClock,
    _Handler,
)

from trainwarden.agent.loop import UNLISTED_MOVE, Agent


@pytest.fixture
def served_supervisor(tmp_path: Path) -> Iterator[tuple[str, SupervisorClock, Any]]:
    """The real supervisor app (uvicorn on SQLite in a thread, evaluator not started: the
    test ticks it): its base URL, its clock and the app."""
    from tests.dashboard.browser import serve_in_thread
    from trainwarden.supervisor.config import SupervisorSettings
    from trainwarden.supervisor.server.app import create_app

    settings = SupervisorSettings(agent_token=AGENT_TOKEN, operator_token=OPERATOR_TOKEN,
                                  data_dir=tmp_path / "sup")
    (tmp_path / "sup").mkdir()
    clock = SupervisorClock()
    app = create_app(settings, clock=clock, start_evaluator=False)
    with serve_in_thread(app) as base:
        yield base, clock, app


@pytest.fixture
def agents() -> Iterator[list[Agent]]:
    """Agents made by a test; their workers are stopped and sockets closed afterwards."""
    made: list[Agent] = []
    yield made
    for a in made:
        try:
            a.launcher.stop()
        finally:
            a.close()


@pytest.fixture
def fake_supervisor() -> FakeSupervisor:
    return FakeSupervisor()


@pytest.fixture
def http_supervisor() -> Iterator[tuple[FakeSupervisor, str]]:
    """A real HTTP server on 127.0.0.1 in a thread, backed by a FakeSupervisor."""
    fake = FakeSupervisor()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.fake = fake  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def fake_run(tmp_path: Path) -> Iterator[FakeRun]:
    run = FakeRun(tmp_path)
    try:
        yield run
    finally:
        run.kill_all()  # a failing test must not leave workers behind


class _UnlistedMoves(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.moves: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(UNLISTED_MOVE):
            self.moves.append(message)


@pytest.fixture(autouse=True)
def no_unlisted_state_move(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every agent test fails when an agent in it made a state move ``AGENT_TRANSITIONS``
    does not list (the agent only logs it: it never stops on its own bookkeeping)."""
    handler = _UnlistedMoves()
    logger = logging.getLogger("trainwarden.agent.loop")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
    if "allow_unlisted_state_move" not in request.keywords:
        assert handler.moves == [], handler.moves

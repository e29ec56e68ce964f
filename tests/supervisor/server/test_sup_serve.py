"""Slow and idle clients against the real server (``serve.uvicorn_config``: uvicorn with the
read deadlines, keep-alive and connection cap), over real sockets: a request trickled a byte
at a time is cut off at its deadline with 408, an idle connection is closed, the connection
cap answers 503; and the same defaults in the ``trainwarden supervisor`` a user starts."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from tests.dashboard.browser import supervisor_process
from tests.waiting import wait_for
from trainwarden.supervisor.config import HttpConfig, SupervisorSettings
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.server.serve import uvicorn_config

AGENT_TOKEN, OPERATOR_TOKEN = "agent-secret", "operator-secret"
HEADER_S, BODY_S, KEEP_ALIVE_S, MAX_CONNECTIONS = 1.0, 1.5, 2, 3
# A deadline is never early; how late it may fire on this loaded machine.
SLACK_S = 1.5


@dataclass
class Server:
    host: str
    port: int
    uvicorn: uvicorn.Server

    def connections(self) -> int:
        return len(self.uvicorn.server_state.connections)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    settings = SupervisorSettings(
        agent_token=AGENT_TOKEN, operator_token=OPERATOR_TOKEN, port=0, log_level="warning",
        data_dir=tmp_path_factory.mktemp("sup"), http_header_timeout_s=HEADER_S,
        http_body_timeout_s=BODY_S, http_keep_alive_s=KEEP_ALIVE_S,
        http_max_connections=MAX_CONNECTIONS)
    srv = uvicorn.Server(uvicorn_config(create_app(settings), settings))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    wait_for(lambda: srv.started, 30, "uvicorn to start")
    port = srv.servers[0].sockets[0].getsockname()[1]
    try:
        yield Server("127.0.0.1", port, srv)
    finally:
        srv.should_exit = True
        th.join(timeout=10)


def connect(host: str, port: int) -> socket.socket:
    s = socket.create_connection((host, port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def trickle(s: socket.socket, data: bytes, every_s: float, give_up_s: float
            ) -> tuple[float, bytes]:
    """Send ``data`` a byte every ``every_s`` until the server closes the connection; returns
    (seconds from the first byte to the close, what the server sent)."""
    t0 = time.monotonic()
    got = b""
    for i in range(len(data)):
        try:
            s.sendall(data[i : i + 1])
        except OSError:
            break
        ready, _, _ = select.select([s], [], [], every_s)  # pacing: the server may answer
        if ready:
            got += read_to_close(s, give_up_s)
            break
        if time.monotonic() - t0 > give_up_s:
            break
    else:
        got += read_to_close(s, give_up_s)
    return time.monotonic() - t0, got


def read_to_close(s: socket.socket, timeout_s: float) -> bytes:
    """Everything until the server closes (or ``timeout_s`` passes: then b"<open>")."""
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([s], [], [], deadline - time.monotonic())
        if not ready:
            break
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk
    return out + b"<open>"


def request(path: str = "/healthz", *, keep_alive: bool = True) -> bytes:
    conn = b"keep-alive" if keep_alive else b"close"
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nConnection: " + conn + b"\r\n\r\n"


def test_headers_trickled_a_byte_at_a_time_are_cut_off_with_408(server: Server) -> None:
    with connect(server.host, server.port) as s:
        took, got = trickle(s, request(), every_s=0.25, give_up_s=10)
    assert got.startswith(b"HTTP/1.1 408"), got[:100]
    assert not got.endswith(b"<open>"), "the connection is closed"
    # A byte every 0.25 s would keep an idle timer of 1 s alive forever: this is a total.
    assert HEADER_S - 0.3 <= took <= HEADER_S + SLACK_S, took


def test_the_next_request_on_a_kept_connection_has_the_same_deadline(server: Server) -> None:
    with connect(server.host, server.port) as s:
        s.sendall(request())
        first = b""
        while not first.rstrip().endswith(b"}"):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        # The keep-alive timer stops at the first byte; the header deadline starts there.
        took, got = trickle(s, request(), every_s=0.25, give_up_s=10)
    assert got.startswith(b"HTTP/1.1 408"), got[:100]
    assert HEADER_S - 0.3 <= took <= HEADER_S + SLACK_S, took


def test_a_body_trickled_a_byte_at_a_time_is_cut_off_with_408(server: Server) -> None:
    head = (b"POST /api/v1/ingest HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + AGENT_TOKEN.encode() + b"\r\nContent-Length: 200\r\n\r\n")
    with connect(server.host, server.port) as s:
        s.sendall(head)
        took, got = trickle(s, b"{" + b" " * 199, every_s=0.25, give_up_s=10)
    assert got.startswith(b"HTTP/1.1 408"), got[:100]
    assert not got.endswith(b"<open>")
    assert BODY_S - 0.5 <= took <= BODY_S + SLACK_S, took


def test_a_connection_that_sends_nothing_is_closed(server: Server) -> None:
    with connect(server.host, server.port) as s:
        t0 = time.monotonic()
        got = read_to_close(s, 10)
        took = time.monotonic() - t0
    assert got == b"", "closed without a word: nothing was asked"
    assert took <= HEADER_S + SLACK_S, took


def test_an_idle_keep_alive_connection_is_closed(server: Server) -> None:
    with connect(server.host, server.port) as s:
        s.sendall(request())
        first = b""
        while b"\r\n\r\n" not in first or not first.rstrip().endswith(b"}"):
            first += s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first[:100]
        t0 = time.monotonic()
        rest = read_to_close(s, 10)
        took = time.monotonic() - t0
    assert rest == b""
    assert KEEP_ALIVE_S - 0.3 <= took <= KEEP_ALIVE_S + SLACK_S, took


def test_past_the_connection_cap_requests_get_503(server: Server) -> None:
    wait_for(lambda: server.connections() == 0, 10, "the other tests' connections to go")
    idle = [connect(server.host, server.port) for _ in range(MAX_CONNECTIONS)]
    try:
        wait_for(lambda: server.connections() == MAX_CONNECTIONS, 10, "the server to hold them")
        with connect(server.host, server.port) as s:
            s.sendall(request())
            got = read_to_close(s, 10)
        assert got.startswith(b"HTTP/1.1 503"), got[:100]
        assert not got.endswith(b"<open>"), "the refused connection is closed"
        # The idle ones are closed by the header deadline; the cap frees up.
        for c in idle:
            assert read_to_close(c, HEADER_S + SLACK_S + 1) == b""
        wait_for(lambda: server.connections() == 0, 10, "the slots to free")
        with connect(server.host, server.port) as s:
            s.sendall(request(keep_alive=False))
            assert read_to_close(s, 10).startswith(b"HTTP/1.1 200")
    finally:
        for c in idle:
            c.close()


def test_the_supervisor_a_user_starts_has_the_deadlines(tmp_path: Path) -> None:
    """``trainwarden supervisor`` with its defaults (10 s for headers, 5 s keep-alive):
    a silent connection, a trickled request and an idle keep-alive one, side by side."""
    header_s = HttpConfig().header_timeout_s
    keep_alive_s = HttpConfig().keep_alive_s
    with supervisor_process(tmp_path, agent_token=AGENT_TOKEN,
                            operator_token=OPERATOR_TOKEN) as sup:
        host, port = sup.base_url.removeprefix("http://").split(":")
        results: dict[str, tuple[float, bytes]] = {}

        def silent() -> None:
            with connect(host, int(port)) as s:
                t0 = time.monotonic()
                results["silent"] = (0.0, read_to_close(s, 30))
                results["silent"] = (time.monotonic() - t0, results["silent"][1])

        def trickled() -> None:
            with connect(host, int(port)) as s:
                results["trickled"] = trickle(s, request() + b"X" * 200, every_s=2.0,
                                              give_up_s=30)

        def keep_alive() -> None:
            with connect(host, int(port)) as s:
                s.sendall(request())
                got = b""
                while not got.rstrip().endswith(b"}"):
                    got += s.recv(65536)
                t0 = time.monotonic()
                rest = read_to_close(s, 30)
                results["keep-alive"] = (time.monotonic() - t0, rest)

        threads = [threading.Thread(target=f) for f in (silent, trickled, keep_alive)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
    assert results["silent"][1] == b""
    assert header_s - 0.3 <= results["silent"][0] <= header_s + SLACK_S, results["silent"]
    assert results["trickled"][1].startswith(b"HTTP/1.1 408"), results["trickled"]
    assert header_s - 0.3 <= results["trickled"][0] <= header_s + 2 + SLACK_S
    assert results["keep-alive"][1] == b""
    assert keep_alive_s - 0.3 <= results["keep-alive"][0] <= keep_alive_s + SLACK_S

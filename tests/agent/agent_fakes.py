"""Test doubles for the agent: a fake supervisor (in-process transport or a real HTTP server
thread), fake torchrun commands, and a polling helper (no fixed sleeps)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import httpx
import psutil

from trainwarden.agent.config import AgentConfig

HERE = Path(__file__).resolve().parent
FAKE_TORCHRUN = HERE / "fake_torchrun.py"
REPO = HERE.parents[1]




class FakeSupervisor:
    """The supervisor's agent API as the agent sees it: register, ingest (idempotent by seq),
    commands re-sent until a ``command_result`` acknowledges them."""

    def __init__(self, token: str | None = "agent-token") -> None:
        self.token = token
        self.lock = threading.Lock()
        self.batches: dict[int, dict[str, Any]] = {}
        self.arrivals: list[int] = []  # seqs in arrival order, duplicates included
        self.duplicates = 0
        self.down: str | None = None  # None | "connect" | an HTTP status such as "503"
        self.status_for_seq: dict[int, int] = {}
        self.commands: dict[int, dict[str, Any]] = {}
        self.registers: list[dict[str, Any]] = []
        self.register_status: int | None = None  # set: registrations answered this
        self.log: list[tuple[str, Any]] = []  # ("register", roots) / ("ingest", seq) in order
        self.next_seq = 0
        self.attempt = 0
        self.protect: list[str] | None = None  # None: an older supervisor (no field)
        self.run_uuid: str | None = "uuid-of-run-1"  # None: an older supervisor (no field)
        self.membership: dict[str, Any] | None = None  # the registration reply's, when set
        self.finished: str | None = None  # the run has ended: registration answers 409

    # -- behaviour ---------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers: dict[str, str],
               body: bytes) -> tuple[int, dict[str, Any]]:
        with self.lock:
            if self.down is not None and self.down.isdigit():
                return int(self.down), {"detail": "down"}
            if self.token and headers.get("authorization") != f"Bearer {self.token}":
                return 401, {"detail": "bad token"}
            data = json.loads(body) if body else {}
            if method == "POST" and path == "/api/v1/agents/register":
                self.registers.append(data)
                self.log.append(("register", data.get("checkpoint_roots")))
                if self.register_status is not None:
                    return self.register_status, {"detail": "refused"}
                if self.finished:
                    return 409, {"detail": self.finished}
                stored = max(self.batches, default=-1) + 1
                reg = {"agent_id": 7, "run_id": 1, "attempt": self.attempt,
                       "next_seq": max(self.next_seq, stored), "heartbeat_interval_s": 1.0}
                if self.run_uuid is not None:
                    reg["run_uuid"] = self.run_uuid
                if self.membership is not None:
                    reg["membership"] = self.membership
                return 200, reg
            if method == "POST" and path == "/api/v1/ingest":
                seq = data["seq"]
                if seq in self.status_for_seq:
                    return self.status_for_seq[seq], {"detail": "bad batch"}
                self.arrivals.append(seq)
                self.log.append(("ingest", seq))
                dup = seq in self.batches
                if dup:
                    self.duplicates += 1
                else:
                    self.batches[seq] = data
                for item in data.get("items", []):
                    if item.get("type") == "command_result":
                        self.commands.pop(item["command_id"], None)
                reply = {"seq": seq, "duplicate": dup, "attempt": self.attempt,
                         "commands": list(self.commands.values())}
                if self.protect is not None:
                    reply["protect"] = list(self.protect)
                return 200, reply
            return 404, {"detail": "not found"}

    # -- inspection --------------------------------------------------------------------------

    def items(self, kind: str | None = None) -> list[dict[str, Any]]:
        with self.lock:
            out = []
            for seq in sorted(self.batches):
                out += [i for i in self.batches[seq]["items"] if kind in (None, i.get("type"))]
            return out

    def seqs(self) -> list[int]:
        with self.lock:
            return sorted(self.batches)

    # -- transports --------------------------------------------------------------------------

    def transport(self) -> httpx.MockTransport:
        def respond(request: httpx.Request) -> httpx.Response:
            if self.down == "connect":
                raise httpx.ConnectError("connection refused", request=request)
            headers = {k.lower(): v for k, v in request.headers.items()}
            code, body = self.handle(request.method, request.url.path, headers,
                                     request.read())
            return httpx.Response(code, json=body)

        return httpx.MockTransport(respond)


class _Handler(BaseHTTPRequestHandler):
    fake: FakeSupervisor

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        headers = {k.lower(): v for k, v in self.headers.items()}
        code, reply = self.server.fake.handle("POST", self.path, headers, body)  # type: ignore[attr-defined]
        data = json.dumps(reply).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass


class FakeRun:
    """A fake torchrun command and the directory where its processes record themselves."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.pid_dir = tmp_path / "pids"
        self.pid_dir.mkdir()
        self.state_dir = tmp_path / "state"

    def command(self, mode: str = "serve", *extra: str) -> list[str]:
        return [sys.executable, str(FAKE_TORCHRUN), "--mode", mode, "--pid-dir",
                str(self.pid_dir), *extra]

    def config(self, mode: str = "serve", *extra: str, url: str = "http://supervisor.test",
               **kw: Any) -> AgentConfig:
        kw.setdefault("stop_grace_s", 0.5)
        kw.setdefault("flush_timeout_s", 2.0)
        kw.setdefault("checkpoint_root", self.tmp_path / "ckpt")
        kw.setdefault("register_wait_s", 1.0)  # tests with a supervisor down start soon
        return AgentConfig(supervisor_url=url, run="run1", node="node1",
                           command=self.command(mode, *extra), token="agent-token",
                           state_dir=self.state_dir, **kw)

    def records(self, role: str | None = None) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.pid_dir.glob("*.json")):
            try:
                rec = json.loads(p.read_text())
            except (OSError, ValueError):
                continue
            if role in (None, rec["role"]):
                out.append(rec)
        return out

    def pids(self, role: str | None = None) -> list[int]:
        return [r["pid"] for r in self.records(role)]

    def alive(self, role: str | None = None) -> list[int]:
        out = []
        for pid in self.pids(role):
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(pid)
            except psutil.Error:
                pass
        return out

    def kill_all(self) -> None:
        for pid in self.alive():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)




AGENT_TOKEN, OPERATOR_TOKEN = "agent-secret", "operator-secret"  # the served supervisor's


class SupervisorClock:
    """The real supervisor's clock, in the test's hands (starts at the real time)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

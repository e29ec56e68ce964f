"""The real system in subprocesses: a supervisor on SQLite and node agents running torchrun."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.torchrun import EXAMPLES, TORCHRUN, worker_env
from tests.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
AGENT_TOKEN = "e2e-agent-token"
OPERATOR_TOKEN = "e2e-operator-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_rendezvous_port(span: int = 10) -> int:
    """A rendezvous port for a multi-node command, as a user picks one (torchrun's 29400):
    below the kernel's ephemeral range, so no client connection (gloo's, a store's) holds it
    or the next ``span`` ports the agent moves it to with the membership epoch; free now."""
    low = 32768
    with contextlib.suppress(OSError, ValueError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(max(1024, low - 12000), low - 100)
        try:
            for port in range(base, base + span):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {span} free ports below the ephemeral range ({low})")


def wait_until(cond: Any, timeout: float, what: str, interval: float = 0.2) -> Any:
    """``tests.waiting.wait_for`` at the pace of real processes (each poll is an HTTP read
    or a process listing)."""
    return wait_for(cond, timeout, what, interval=interval)


@contextlib.contextmanager
def postgres_schema(base_url: str) -> Iterator[str]:
    """A fresh, empty schema on the test Postgres, as the URL of a database whose search
    path is that schema (replicas started with it share it); dropped afterwards."""
    from sqlalchemy import create_engine, text

    name = f"tw_e2e_{uuid.uuid4().hex[:10]}"
    eng = create_engine(base_url, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f"CREATE SCHEMA {name}"))
    sep = "&" if "?" in base_url else "?"
    try:
        yield f"{base_url}{sep}options=-csearch_path%3D{name}"
    finally:
        with eng.connect() as c:
            c.execute(text(f"DROP SCHEMA {name} CASCADE"))
        eng.dispose()


class Supervisor:
    """``trainwarden supervisor`` as a subprocess; restartable on the same port and database."""

    def __init__(self, data_dir: Path, port: int | None = None, *extra: str,
                 env: dict[str, str] | None = None, host: str = "127.0.0.1") -> None:
        """``host``: the address it listens on (a bridge's, for agents in namespaces)."""
        self.data_dir = data_dir
        self.env = dict(env or {})
        self.port = port or free_port()
        self.extra = [*extra, *(("--server-host", host) if host != "127.0.0.1" else ())]
        self.url = f"http://{host}:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = data_dir / "supervisor.log"
        data_dir.mkdir(parents=True, exist_ok=True)

    def start(self) -> Supervisor:
        env = {**worker_env(), "TRAINWARDEN_AGENT_TOKEN": AGENT_TOKEN,
               "TRAINWARDEN_OPERATOR_TOKEN": OPERATOR_TOKEN, **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor", "--data-dir",
                 str(self.data_dir), "--port", str(self.port), "--log-level", "warning",
                 *self.extra], env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        wait_until(self._healthy, 60, "the supervisor to answer /healthz")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(f"supervisor exited {self.proc.returncode}:\n{self.tail()}")
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def pause(self) -> None:
        """SIGSTOP: the process stays, silent (its connections accepted, never answered)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused one must be able to exit
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}/api/v1{path}", timeout=10,
                      headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
        r.raise_for_status()
        return r.json()

    def get_or_none(self, path: str) -> Any:
        """The JSON, or None while the supervisor is down or does not know it yet (404)."""
        try:
            r = httpx.get(f"{self.url}/api/v1{path}", timeout=10,
                          headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
        except httpx.HTTPError:
            return None
        if r.status_code == 404:
            return None
        r.raise_for_status()
        return r.json()

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


class Agent:
    """``trainwarden agent ... -- torchrun ...`` as a subprocess."""

    def __init__(self, supervisor_url: str, run: str, node: str, workdir: Path,
                 torchrun_args: list[str], *, xdg_state_home: Path | None = None,
                 agent_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 wrap: tuple[str, ...] = ()) -> None:
        """``xdg_state_home``: use the default state location under it (no --state-dir), as
        a user who passes no flag gets; ``agent_args``: more agent options (``--spare``);
        ``wrap``: a command prefix that execs the agent (``ip netns exec NS``: the agent's
        process is still ``proc``)."""
        self.workdir = workdir
        self.log = workdir / f"agent-{node}.log"
        workdir.mkdir(parents=True, exist_ok=True)
        env = {**worker_env(), "TRAINWARDEN_AGENT_TOKEN": AGENT_TOKEN, **(env or {})}
        state = ["--state-dir", str(workdir / f"state-{node}")]
        if xdg_state_home is not None:
            env["XDG_STATE_HOME"] = str(xdg_state_home)
            state = []
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [*wrap, sys.executable, "-m", "trainwarden.agent.cli",
                 "--supervisor", supervisor_url,
                 "--run", run,
                 "--node", node, *state, "--stop-grace", "2", *agent_args, "--", TORCHRUN,
                 "--monitor-interval=0.1", *torchrun_args],
                env=env, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"agent did not finish in {timeout}s:\n{self.tail()}") from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def tail(self, n: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def tree(self) -> list[Any]:
        """The agent's whole process tree (the agent, torchrun, the workers): a node."""
        import psutil

        try:
            me = psutil.Process(self.proc.pid)
            return [me, *me.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_tree(self, sig: signal.Signals) -> list[int]:
        """``sig`` to every process of the node at once (SIGKILL: the node dies; SIGSTOP: it
        freezes); returns their pids."""
        procs = self.tree()
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
        return [p.pid for p in procs]


def ddp_script(*args: str) -> list[str]:
    return [str(EXAMPLES / "train_ddp.py"), *args]


def env_without_trainwarden() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}

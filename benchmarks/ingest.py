"""Supervisor ingest benchmark: simulated node agents against a real supervisor subprocess.

Each simulated agent is one node of 8 ranks of a single run: at a level of N agents, agent k
reports ranks 8k..8k+7 of a world of 8N ranks, so the supervisor sees 8N distinct ranks, as it
would from a real N-node job.  Each trains a step a second and sends a batch of the steps done
so far (with the heartbeat the node agent puts in every batch, with its 8 workers) every
second, or as often as the supervisor's replies ask (backpressure), at its own phase of the
interval, as the agent does, over its own keep-alive HTTP connection; it registers first and
starts right after, as a node agent does (the measured seconds begin once every agent has
registered and warmed up).  Every level starts a fresh supervisor on a fresh database, with
the evaluator ticking as it does in production.  For each level the table shows the
sustained rank-steps/s against the offered load, the p50/p99 ingest latency (from when the
batch was due, so a backlog counts), the supervisor's RSS and CPU (its detectors' process
included), the ratio of its CPU per stored rank-step to a raw bulk insert of the same rows
into a database of its own (measured after the level, with no supervisor running), the
longest batch interval it asked for, the incidents it opened on the healthy run, and the
acknowledged rows missing from the store or stored twice (read from the database after the
level).  The largest level with p99 < 100 ms, no error and every acknowledged row stored
once is reported at the end.

    .venv/bin/python benchmarks/ingest.py                      # SQLite, then Postgres if set
    .venv/bin/python benchmarks/ingest.py --db sqlite --agents 64,256,512,768 --seconds 10
    .venv/bin/python benchmarks/ingest.py --db postgres \\
        --postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/test

The load generator is one asyncio process with hand-written HTTP/1.1 (a full HTTP client
would cost more CPU than the server on a 2-core machine and measure itself).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import math
import os
import random
import shlex
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-agent-token"
OP_TOKEN = "bench-operator-token"
RANKS = 8
P99_TARGET_MS = 100.0
# When a simulated node sends its next batch (the first is the default).  The load generator
# is written apart from the agent's code, so ``next_slot`` says again what
# ``trainwarden.agent.schedule``
# does, in its own words.
SCHEDULES = ("phase", "after-last")


@dataclass
class Level:
    agents: int
    seconds: float
    sent: int = 0
    ok: int = 0
    rows: int = 0  # rank-step rows acknowledged
    errors: int = 0
    max_interval_s: float = 1.0  # the longest batch interval the supervisor asked for
    incidents: int = -1  # opened on the (healthy) run during the level
    # node -> its steps the supervisor acknowledged (0..n-1 of each of its ranks), the whole
    # level (warmup included); checked against the store after the level
    acked_steps: dict[int, int] = field(default_factory=dict)
    lost: int = -1  # acknowledged (rank, step) rows missing from the store
    doubled: int = -1  # (rank, step) rows stored more than once
    replicas: int = 1  # supervisor processes sharing the database
    schedule: str = SCHEDULES[0]  # when a node's next batch goes
    latencies_ms: list[float] | None = None
    rss_mb: float = 0.0
    cpu_s: float = 0.0
    wall_s: float = 0.0

    @property
    def rank_steps_per_s(self) -> float:
        return self.rows / self.wall_s if self.wall_s else 0.0

    def held(self) -> bool:
        """The level met the target: p99 < 100 ms, no error, every acknowledged row stored
        once."""
        return (self.pct(0.99) <= P99_TARGET_MS and not self.errors and self.lost == 0
                and self.doubled == 0)

    def pct(self, q: float) -> float:
        lat = sorted(self.latencies_ms or [0.0])
        return lat[min(len(lat) - 1, int(q * len(lat)))]


# --------------------------------------------------------------------------------------------
# supervisor process


class Supervisor:
    def __init__(self, db_url: str, workdir: Path) -> None:
        self.port_file = workdir / f"port-{uuid.uuid4().hex[:6]}"
        self.db_url = db_url
        env = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": TOKEN,
               "TRAINWARDEN_OPERATOR_TOKEN": OP_TOKEN,
               "TRAINWARDEN_MAX_BODY_BYTES": str(4 * 1024 * 1024)}
        self.cmd = [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor",
                    "--db", db_url,
                    "--port", "0", "--port-file", str(self.port_file),
                    "--log-level", "warning"]
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=env)
        deadline = time.monotonic() + 60
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("supervisor did not start")
            time.sleep(0.05)
        self.port = int(self.port_file.read_text())
        self.ps = psutil.Process(self.proc.pid)

    def _procs(self) -> list[psutil.Process]:
        """The supervisor and its children (the detectors' process)."""
        try:
            return [self.ps, *self.ps.children(recursive=True)]
        except psutil.Error:
            return [self.ps]

    def cpu_s(self) -> float:
        total = 0.0
        for p in self._procs():
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system
        return total

    def rss_mb(self) -> float:
        total = 0
        for p in self._procs():
            with contextlib.suppress(psutil.Error):
                total += p.memory_info().rss
        return total / 2**20

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# --------------------------------------------------------------------------------------------
# load generator


def bulk_insert_rank_steps(conn: Any, *, rows: list[dict[str, Any]]) -> None:
    """The baseline the ingest path is compared with: a raw bulk insert of the same per-rank
    step rows, in one statement (benchmark-only: nothing in the package writes rows this
    way)."""
    from trainwarden.supervisor.store.tables import rank_steps

    conn.execute(rank_steps.insert(), rows)


def step_items(step: int, now: float, attempt: int = 0, node: int = 0,
               world: int = RANKS) -> list[dict[str, Any]]:
    """The 8 step reports of node ``node``: global ranks 8*node .. 8*node+7 of ``world``."""
    out = []
    for local in range(RANKS):
        r = node * RANKS + local
        data_s = 0.002 + random.random() * 0.003
        compute_s = 0.12 + random.random() * 0.02
        out.append({
            "type": "step", "v": 1, "attempt": attempt, "rank": r, "local_rank": local,
            "world_size": world, "pid": 1000 + local, "step": step, "t": now,
            "batch_index": step * world + r, "loss": 2.5 - step * 1e-4 + random.random() * 0.05,
            "samples": 32, "tokens": 32 * 2048, "lr": 3e-4, "grad_norm": 0.8 + random.random(),
            "data_s": data_s, "compute_s": compute_s, "step_s": 0.95 + random.random() * 0.03,
            "dropped": 0,
        })
    return out


# Pre-formatted random values: the load generator shares the supervisor's 2 cores, and
# formatting ~500 random floats a batch with json.dumps cost it most of a core at 2,048
# agents (a real agent sends from its own node).  The values vary as step_items' do.
_POOL = 1024
_POOL_DATA = [repr(0.002 + random.random() * 0.003) for _ in range(_POOL)]
_POOL_COMPUTE = [repr(0.12 + random.random() * 0.02) for _ in range(_POOL)]
_POOL_STEP_S = [repr(0.95 + random.random() * 0.03) for _ in range(_POOL)]
_POOL_LOSS = [repr(random.random() * 0.05) for _ in range(_POOL)]
_POOL_GRAD = [repr(0.8 + random.random()) for _ in range(_POOL)]
_POOL_CPU = [repr(99.0 + random.random()) for _ in range(_POOL)]


def encode_batch(agent_id: int, seq: int, sent_at: float, made: float, steps: range,
                 node: int, world: int) -> bytes:
    """The JSON body ``json.dumps`` would make of the batch of ``steps`` (``step_items``
    each) and the heartbeat, built from pre-formatted values."""
    t = repr(made)
    out = []
    pick = random.randrange
    for k in steps:
        for local in range(RANKS):
            r = node * RANKS + local
            loss = repr(2.5 - k * 1e-4 + float(_POOL_LOSS[pick(_POOL)]))
            out.append(
                f'{{"type": "step", "v": 1, "attempt": 0, "rank": {r}, "local_rank": {local}, '
                f'"world_size": {world}, "pid": {1000 + local}, "step": {k}, "t": {t}, '
                f'"batch_index": {k * world + r}, "loss": {loss}, "samples": 32, '
                f'"tokens": 65536, "lr": 0.0003, "grad_norm": {_POOL_GRAD[pick(_POOL)]}, '
                f'"data_s": {_POOL_DATA[pick(_POOL)]}, '
                f'"compute_s": {_POOL_COMPUTE[pick(_POOL)]}, '
                f'"step_s": {_POOL_STEP_S[pick(_POOL)]}, "dropped": 0}}')
    workers = ", ".join(
        f'{{"rank": {node * RANKS + i}, "local_rank": {i}, "pid": {1000 + i}, '
        f'"cpu_percent": {_POOL_CPU[pick(_POOL)]}, "rss_bytes": {6 * 2**30}}}'
        for i in range(RANKS))
    out.append(f'{{"type": "heartbeat", "t": {t}, "attempt": 0, "state": "running", '
               f'"workers": [{workers}], "disk_free_bytes": {10**12}, '
               f'"disk_total_bytes": {2 * 10**12}}}')
    return (f'{{"agent_id": {agent_id}, "seq": {seq}, "sent_at": {sent_at!r}, "attempt": 0, '
            f'"dropped": 0, "items": [{", ".join(out)}]}}').encode()


class Conn:
    """Minimal HTTP/1.1 keep-alive client (POST JSON, read a Content-Length response)."""

    def __init__(self, port: int, credential: str = "") -> None:
        self.port, self.credential = port, credential
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"X-Trainwarden-Agent-Credential: {self.credential}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n")
        for _ in range(2):
            if self.writer is None or self.reader is None:
                self.reader, self.writer = await asyncio.open_connection("127.0.0.1",
                                                                         self.port)
            reader = self.reader
            self.writer.write(head.encode() + body)
            status_line = await reader.readline()
            if status_line:
                break
            # The server closed the idle keep-alive connection (its keep-alive timeout is
            # shorter than a backed-off batch interval): send again on a new one, as an
            # HTTP client does.
            self.writer.close()
            self.writer = None
        if not status_line:
            raise ConnectionResetError("the supervisor closed the connection")
        length = 0
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            k, _, v = line.decode().partition(":")
            if k.lower() == "content-length":
                length = int(v)
        payload = await reader.readexactly(length)
        return int(status_line.split()[1]), payload


def heartbeat(now: float, node: int) -> dict[str, Any]:
    """The heartbeat the node agent sends in every batch (its workers' readings)."""
    return {"type": "heartbeat", "t": now, "attempt": 0, "state": "running",
            "workers": [{"rank": node * RANKS + i, "local_rank": i, "pid": 1000 + i,
                         "cpu_percent": 99.0 + random.random(), "rss_bytes": 6 * 2**30}
                        for i in range(RANKS)],
            "disk_free_bytes": 10**12, "disk_total_bytes": 2 * 10**12}


@dataclass
class Window:
    """The measured part of a level: set once every agent has registered."""

    measure_from: float = float("inf")
    end: float = float("inf")


async def agent_loop(port: int, node: int, world: int, run: str, level: Level,
                     window: Window, registered: list[int]) -> None:
    """One node: it registers, then trains a step a second and sends a batch of the steps
    done so far every batch interval (1 s, or what the supervisor's reply asks for while it
    is behind, as the agent does).  Latency is from when the batch was due.

    Each agent starts right after its own registration, as a node agent does: registered
    all at once ahead of the load, the first nodes would be silent for as long as the last
    ones take to register (33 s at 2,048 agents on Postgres), and rightly lost."""
    conn = Conn(port)
    status, reply = await conn.post("/api/v1/agents/register", json.dumps(
        {"run": run, "node": f"node{node:04d}", "hostname": f"h{node}", "pid": 1,
         "command": ["torchrun", f"--nnodes={world // RANKS}"], "nproc_per_node": RANKS}
    ).encode())
    if status != 200:
        raise RuntimeError(f"registration of node {node} failed: {status} {reply[:200]!r}")
    reg = json.loads(reply)
    agent_id, seq, credential = reg["agent_id"], reg["next_seq"], str(reg.get("credential", ""))
    conn.credential = credential
    registered.append(agent_id)
    t0 = time.monotonic()
    offset = random.random()  # agents are not synchronised
    phase = random.random()  # this node's phase of the batch interval
    interval = 1.0
    step = 0  # the next step to report
    due = t0 + offset
    unsent: tuple[bytes, int] | None = None  # a batch not acknowledged, and its last step
    while due < window.end:
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        now = time.time()
        made = now - (time.monotonic() - due)  # when it was due: the agent spools it then
        if unsent is None:
            upto = int(due - (t0 + offset)) + 1  # steps done by now, one a second
            body = encode_batch(agent_id, seq, now, made, range(step, upto), node, world)
        else:  # sent again as it was (same seq, same content), as the agent's spool does
            body, upto = unsent
        try:
            status, reply = await conn.post("/api/v1/ingest", body)
        except (OSError, asyncio.IncompleteReadError):
            status, reply = 0, b""
            conn = Conn(port, credential)
        finished = time.monotonic()
        if status == 200:
            advised = json.loads(reply).get("batch_interval_s")
            interval = float(advised) if advised else 1.0
            level.max_interval_s = max(level.max_interval_s, interval)
        if due >= window.measure_from:
            level.sent += 1
            if status == 200:
                level.ok += 1
                level.rows += (upto - step) * RANKS
                assert level.latencies_ms is not None
                level.latencies_ms.append((finished - due) * 1000)
            else:
                level.errors += 1
        if status == 200:
            step = upto
            level.acked_steps[node] = step
            seq += 1
            unsent = None
        else:
            unsent = (body, upto)
        due = (next_slot(due, interval, phase) if level.schedule == "phase"
               else due + interval)


def next_slot(after: float, interval: float, phase: float) -> float:
    """The node's next batch time: the first boundary ``(k - phase) * interval`` after
    ``after``.  Each node batches at its own phase of the interval, as the agent does, so
    when the supervisor asks every node for a longer interval at once their batches stay
    spread over it (one interval after the previous batch, they would all arrive within the
    second in which they read the advice)."""
    t = (math.floor(after / interval + phase) + 1 - phase) * interval
    # (``after`` on a boundary can round to the slot before it: never the same time again)
    return t if t > after else t + interval


def run_level(sups: list[Supervisor], n_agents: int, seconds: float, warmup: float, *,
              schedule: str) -> Level:
    """One level against one supervisor, or against replicas of one (agent k sends to
    replica k mod N, as a load balancer would spread them)."""
    level = Level(agents=n_agents, seconds=seconds, latencies_ms=[], replicas=len(sups),
                  schedule=schedule)
    run = f"bench-{n_agents}-{uuid.uuid4().hex[:4]}"

    def cpu_s() -> float:
        return sum(s.cpu_s() for s in sups)

    async def main() -> None:
        world = n_agents * RANKS
        window = Window()
        registered: list[int] = []
        reg0 = time.monotonic()
        tasks = [asyncio.create_task(agent_loop(sups[node % len(sups)].port, node, world, run,
                                                level, window, registered))
                 for node in range(n_agents)]
        deadline = reg0 + 300
        while len(registered) < n_agents:  # the warmup counts from the last registration
            failed = [t for t in tasks if t.done() and t.exception() is not None]
            if failed:
                raise failed[0].exception()  # type: ignore[misc]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(registered)} of {n_agents} agents registered in "
                                   "300 s")
            await asyncio.sleep(0.1)
        print(f"   {n_agents} agents registered in {time.monotonic() - reg0:.1f} s",
              flush=True)
        # The generator's own collector must not pause 2,048 nodes at once (its pauses
        # would count as the supervisor's latency): what the setup made is frozen.
        gc.collect()
        gc.freeze()
        window.measure_from = time.monotonic() + warmup
        window.end = window.measure_from + seconds
        await asyncio.sleep(warmup)
        cpu0, w0 = cpu_s(), time.monotonic()
        rss = 0.0
        while time.monotonic() < window.end:
            await asyncio.sleep(0.5)
            rss = max(rss, sum(s.rss_mb() for s in sups))
        await asyncio.gather(*tasks)  # drain: a backlog shows as latency and lower rate
        gc.unfreeze()
        level.cpu_s = cpu_s() - cpu0
        level.wall_s = max(seconds, time.monotonic() - w0)
        level.rss_mb = rss

    asyncio.run(main())
    with httpx.Client(base_url=f"http://127.0.0.1:{sups[0].port}", timeout=30,
                      headers={"Authorization": f"Bearer {OP_TOKEN}"}) as c:
        opened = c.get(f"/api/v1/runs/{run}/incidents").json()["incidents"]
    level.incidents = len(opened)
    level.lost, level.doubled = check_stored(sups[0].db_url, run, level.acked_steps)
    for inc in opened:  # (there should be none: say what they were)
        print(f"   incident on the healthy run: {inc.get('kind')}: {inc.get('summary')} "
              f"{inc.get('details')}"[:600], flush=True)
    return level


def check_stored(db_url: str, run: str, acked_steps: dict[int, int]) -> tuple[int, int]:
    """The acknowledged rows against the store: (missing, stored more than once).  Node k
    acknowledged steps 0..acked_steps[k]-1 of each of its ranks 8k..8k+7."""
    from sqlalchemy import create_engine, text

    eng = create_engine(db_url)
    try:
        with eng.connect() as c:
            rows = c.execute(text(
                "SELECT rank, step, count(*) FROM rank_steps WHERE run_id = "
                "(SELECT id FROM runs WHERE name = :run) GROUP BY rank, step"), {"run": run})
            stored = {(int(r), int(st)): int(n) for r, st, n in rows}
    finally:
        eng.dispose()
    lost = sum(1 for node, upto in acked_steps.items() for local in range(RANKS)
               for st in range(upto) if (node * RANKS + local, st) not in stored)
    doubled = sum(1 for n in stored.values() if n > 1)
    return lost, doubled


# --------------------------------------------------------------------------------------------
# raw bulk insert baseline (same rows, a database of its own, in this process)


def raw_insert_cost_per_row(db_url: str, rows: int) -> float:
    sys.path.insert(0, str(REPO))
    from trainwarden.supervisor.contract.wire import RegisterRequest
    from trainwarden.supervisor.store import migrate, registry
    from trainwarden.supervisor.store.db import make_database

    migrate.upgrade(db_url)
    db = make_database(db_url, pool_size=1)
    try:
        with db.write() as conn:
            reg = registry.register_agent(conn, req=RegisterRequest(run="raw-baseline", node="n"),
                                      now=time.time())
        now = time.time()
        payload = []
        for s in range(rows // RANKS + 1):
            for it in step_items(0, now, node=s, world=(rows // RANKS + 1) * RANKS):
                payload.append({
                    "run_id": reg["run_id"], "attempt": 0, "step": it["step"],
                    "rank": it["rank"], "t": it["t"], "batch_index": it["batch_index"],
                    "data_s": it["data_s"], "compute_s": it["compute_s"],
                    "step_s": it["step_s"], "loss": it["loss"], "loss_special": None,
                    "grad_norm": it["grad_norm"], "grad_norm_special": None, "lr": it["lr"],
                })
        payload = payload[:rows]
        t = time.perf_counter()
        for i in range(0, len(payload), 10_000):
            with db.write() as conn:
                bulk_insert_rank_steps(conn, rows=payload[i:i + 10_000])
        return (time.perf_counter() - t) / len(payload)
    finally:
        db.dispose()


# --------------------------------------------------------------------------------------------


def bench_db(name: str, fresh_url: Callable[[str], ContextManager[str]], levels: list[int],
             seconds: float, warmup: float, stop_after_miss: bool, *, schedule: str,
             replicas: int = 1) -> list[tuple[Level, float]]:
    """Each level on a fresh supervisor (``replicas`` of them on Postgres) and database
    (``fresh_url(label)`` makes one and drops it after), then the raw-insert baseline on
    another fresh database."""
    with fresh_url("cmd") as shown:
        print(f"\n== {name}: supervisor command:\n   TRAINWARDEN_AGENT_TOKEN=... "
              f"TRAINWARDEN_OPERATOR_TOKEN=... {shlex.join(Supervisor_cmd(shown))}", flush=True)
    out: list[tuple[Level, float]] = []
    for n in levels:
        with tempfile.TemporaryDirectory() as tmp, fresh_url(f"level{n}") as url:
            sups: list[Supervisor] = []
            try:
                for _ in range(replicas):  # one after the other: the first one migrates
                    sups.append(Supervisor(url, Path(tmp)))
                lvl = run_level(sups, n, seconds, warmup, schedule=schedule)
            finally:
                for sup in sups:
                    sup.stop()
        with fresh_url(f"raw{n}") as url:
            raw = raw_insert_cost_per_row(url, max(lvl.rows, 1000))
        out.append((lvl, raw))
        print_row(name, lvl, raw)
        if stop_after_miss and not lvl.held():
            break
    return out


def Supervisor_cmd(db_url: str) -> list[str]:
    return [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor", "--db", db_url,
            "--port",
            "8765"]


HEADER = (f"{'db':<9}{'repl':>5}{'agents':>7}{'ranks':>7}{'rank-steps/s':>14}{'offered':>9}"
          f"{'ok':>7}{'err':>5}{'p50 ms':>9}{'p99 ms':>9}{'sup CPU%':>10}{'RSS MB':>8}"
          f"{'x raw insert':>14}{'batch s':>9}{'incidents':>11}{'lost/doubled':>14}")


def print_row(name: str, lvl: Level, raw_s_per_row: float) -> None:
    """One level: ``offered`` is the rank-steps/s the simulated nodes train (one step a
    second each); ``batch s`` the longest batch interval the supervisor asked for
    (backpressure); ``incidents`` those opened on the healthy run (should be 0);
    ``lost/doubled`` the acknowledged rank-step rows missing from the store and the rows
    stored twice (both should be 0)."""
    cpu_per_row = lvl.cpu_s / lvl.rows if lvl.rows else float("nan")
    ratio = cpu_per_row / raw_s_per_row if raw_s_per_row else float("nan")
    print(f"{name:<9}{lvl.replicas:>5}{lvl.agents:>7}{lvl.agents * RANKS:>7}"
          f"{lvl.rank_steps_per_s:>14.0f}{lvl.agents * RANKS:>9}{lvl.ok:>7}{lvl.errors:>5}"
          f"{lvl.pct(0.5):>9.1f}"
          f"{lvl.pct(0.99):>9.1f}{100 * lvl.cpu_s / lvl.wall_s:>10.0f}{lvl.rss_mb:>8.0f}"
          f"{ratio:>14.1f}{lvl.max_interval_s:>9.1f}{lvl.incidents:>11}"
          f"{f'{lvl.lost}/{lvl.doubled}':>14}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    p.add_argument("--postgres-url", default=os.environ.get("TRAINWARDEN_TEST_POSTGRES_URL"))
    p.add_argument("--agents", default="64,128,256,512,768,1024",
                   help="comma-separated load levels (agents of 8 ranks each)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per level")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--replicas", default="1",
                   help="Postgres: comma-separated supervisor replica counts to measure "
                        "(e.g. 1,2: the scaling from one replica to two)")
    p.add_argument("--schedule", choices=SCHEDULES, default=SCHEDULES[0],
                   help="when a simulated node sends its next batch: 'phase' at its own phase "
                        "of the interval, as the agent does; 'after-last' one interval after "
                        "its previous batch, for comparison (nodes told to batch less often "
                        "in the same second then stay bunched in that second)")
    p.add_argument("--all-levels", action="store_true",
                   help="keep going after a level misses the p99 target")
    args = p.parse_args()
    levels = [int(x) for x in args.agents.split(",")]
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"machine: {os.cpu_count()} CPUs; {RANKS} ranks per agent, 1 batch/agent/s; "
          f"batch schedule: {args.schedule}")
    results: dict[str, list[tuple[Level, float]]] = {}
    if args.db in ("sqlite", "both"):
        results["sqlite"] = bench_db("sqlite", sqlite_url, levels, args.seconds, args.warmup,
                                     not args.all_levels, schedule=args.schedule)
    if args.db in ("postgres", "both"):
        if not args.postgres_url:
            print("\n(no --postgres-url / TRAINWARDEN_TEST_POSTGRES_URL: Postgres skipped)")
        else:
            for n in [int(x) for x in args.replicas.split(",")]:
                results[f"postgres x{n}" if n > 1 else "postgres"] = bench_db(
                    "postgres", lambda label: postgres_url(args.postgres_url, label),
                    levels, args.seconds, args.warmup, not args.all_levels, replicas=n,
                    schedule=args.schedule)
    print("\n" + HEADER)
    for name, rows in results.items():
        for lvl, raw in rows:
            print_row(name.split()[0], lvl, raw)  # (the replicas have a column)
    for name, rows in results.items():
        good = [lvl for lvl, _ in rows if lvl.held()]
        best = max(good, key=lambda lv: lv.agents) if good else None
        print(f"{name}: largest cluster with p99 < {P99_TARGET_MS:.0f} ms: "
              + (f"{best.agents} agents x {RANKS} ranks = {best.agents * RANKS} ranks "
                 f"({best.rank_steps_per_s:.0f} rank-steps/s)" if best else "none"))
    return 0


@contextlib.contextmanager
def sqlite_url(label: str) -> Iterator[str]:
    with tempfile.TemporaryDirectory() as tmp:
        yield f"sqlite:///{tmp}/bench-{label}.db"


@contextlib.contextmanager
def postgres_url(base: str, label: str) -> Iterator[str]:
    """A schema of its own in the Postgres database, dropped after."""
    from sqlalchemy import create_engine, text

    schema = f"tw_bench_{label}_{uuid.uuid4().hex[:8]}"
    eng = create_engine(base, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(text(f"CREATE SCHEMA {schema}"))
    sep = "&" if "?" in base else "?"
    try:
        yield f"{base}{sep}options=-csearch_path%3D{schema}"
    finally:
        with eng.connect() as c:
            c.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        eng.dispose()


if __name__ == "__main__":
    raise SystemExit(main())

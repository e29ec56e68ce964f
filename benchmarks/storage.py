"""Storage and memory of a long run: store bytes per simulated day at 16,384 ranks, with and
without retention, and the supervisor's RSS after 100k simulated steps.

Bytes.  A 16,384-rank run is 1.4 billion per-rank rows a day: too many to write here.  A
slice is simulated instead: ``--agents`` agents of 8 ranks each report ``--steps`` steps,
every agent one batch per step with a heartbeat (the real ingest path:
``store.ingest.ingest_batches`` on wire ``IngestBatch``es, one write transaction per step, as
the ingest writer groups them), into a SQLite store built by the migrations.  The same slice
is written twice: once as is, once with ``Retention.tick`` after every ``--tick-every`` steps
(the evaluator ticks twice a simulated second).  Each table's bytes (data and indexes, from
SQLite's ``dbstat``) divided by its rows gives its bytes per row; the day at 16,384 ranks
(2,048 agents, a step a second: 86,400 steps) is those bytes times the rows a day adds:

* ``rank_steps``: 16,384 x 86,400 rows without retention; with it a constant window of
  ``keep_steps`` x 16,384 rows (shown apart: it does not grow);
* ``rank_rollups``: 16,384 x 86,400 / ``bucket_steps``; ``step_batches``, ``step_aggregates``:
  86,400;
* ``ingested_batches`` (the key of each stored batch): 2,048 x 86,400 without retention; with
  it a constant ``batch_keys_kept`` x 2,048 keys.

The file's own growth per step over the second half of the retained slice is printed too,
beside what the tables that grow add per step: deleted pages are reused, so the file grows by
the rollups and per-step rows, not by the rows deleted.

RSS.  A real supervisor subprocess (SQLite, the evaluator ticking, retention on) is fed
``--rss-steps`` steps of one 8-rank agent by a load generator that sends ``--rss-batch``
steps per batch as fast as it is answered; its RSS at the end and its peak are printed.

    .venv/bin/python benchmarks/storage.py                 # 64 ranks x 6,000 steps, 100k RSS
    .venv/bin/python benchmarks/storage.py --smoke         # a few seconds: it still works
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RANKS_PER_AGENT = 8
FULL_RANKS = 16_384
FULL_AGENTS = FULL_RANKS // RANKS_PER_AGENT
DAY_STEPS = 86_400  # one step a second
GOAL_GB_PER_DAY = 5.0
GOAL_RSS_MB = 300.0
TOKEN = "bench-agent-token"
OP_TOKEN = "bench-operator-token"


def step_items(agent: int, step: int, now: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for lr in range(RANKS_PER_AGENT):
        rank = agent * RANKS_PER_AGENT + lr
        out.append({
            "type": "step", "v": 1, "attempt": 0, "rank": rank, "local_rank": lr,
            "world_size": FULL_RANKS, "pid": 1000 + lr, "step": step, "t": now,
            "batch_index": step, "loss": 2.5 - step * 1e-5 + random.random() * 0.05,
            "samples": 32, "tokens": 32 * 2048, "lr": 3e-4,
            "grad_norm": 0.8 + random.random(), "data_s": 0.002 + random.random() * 0.003,
            "compute_s": 0.12 + random.random() * 0.02,
            "step_s": 0.95 + random.random() * 0.03})
    return out


def table_bytes(path: Path) -> dict[str, int]:
    """Bytes of each table with its indexes (SQLite's dbstat)."""
    con = sqlite3.connect(path)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        owner = dict(con.execute("SELECT name, tbl_name FROM sqlite_master").fetchall())
        out: dict[str, int] = {}
        for name, size in con.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name"):
            t = owner.get(name, name)
            out[t] = out.get(t, 0) + int(size)
        return out
    finally:
        con.close()


def row_counts(path: Path, tables: list[str]) -> dict[str, int]:
    con = sqlite3.connect(path)
    try:
        return {t: int(con.execute(f'SELECT count(*) FROM "{t}"').fetchone()[0]) for t in tables}
    finally:
        con.close()


def simulate(path: Path, *, agents: int, steps: int, retention: Any, tick_every: int
             ) -> dict[str, Any]:
    """Write the slice into a fresh store at ``path``; what it measured."""
    from trainwarden.supervisor.contract.wire import IngestBatch, RegisterRequest
    from trainwarden.supervisor.store import ingest, migrate, registry
    from trainwarden.supervisor.store.db import make_database

    url = f"sqlite:///{path}"
    migrate.upgrade(url)
    db = make_database(url, pool_size=2)
    t0 = time.time() - steps  # the slice ends now: agent times stay within the clock rule
    with db.write() as conn:
        ids = [int(registry.register_agent(
            conn, req=RegisterRequest(run="storage", node=f"n{a:04d}",
                                      nproc_per_node=RANKS_PER_AGENT), now=t0)["agent_id"])
            for a in range(agents)]
    sizes: list[tuple[int, int]] = []
    wall = time.perf_counter()
    try:
        for s in range(steps):
            now = t0 + s
            batches = [IngestBatch.model_validate({
                "agent_id": aid, "seq": s, "sent_at": now, "attempt": 0,
                "items": [*step_items(a, s, now),
                          {"type": "heartbeat", "t": now, "attempt": 0, "state": "running"}]})
                for a, aid in enumerate(ids)]
            with db.write() as conn:
                ingest.ingest_batches(conn, batches=batches, now=now)
            if retention is not None and s % tick_every == tick_every - 1:
                retention.tick(db)
            if s % 100 == 99:
                sizes.append((s + 1, path.stat().st_size))
    finally:
        db.dispose()
    wall = time.perf_counter() - wall
    by_table = table_bytes(path)
    counts = row_counts(path, ["rank_steps", "rank_rollups", "step_batches", "step_aggregates",
                               "ingested_batches"])
    half = [sz for s, sz in sizes if s >= steps // 2]
    grow = (half[-1] - half[0]) / max(1, (len(half) - 1) * 100) if len(half) > 1 else 0.0
    return {"bytes": by_table, "rows": counts, "file": path.stat().st_size,
            "growth_per_step": grow, "wall_s": wall}


def per_row(m: dict[str, Any], table: str) -> float:
    n = m["rows"].get(table, 0)
    return m["bytes"].get(table, 0) / n if n else 0.0


def bytes_report(args: argparse.Namespace) -> tuple[float, float]:
    from trainwarden.supervisor.control.retention import Retention, RetentionConfig

    ranks = args.agents * RANKS_PER_AGENT
    cfg = RetentionConfig(keep_steps=args.keep_steps, bucket_steps=args.bucket_steps)
    with tempfile.TemporaryDirectory(prefix="rollup-storage-") as tmp:
        plain = simulate(Path(tmp) / "plain.db", agents=args.agents, steps=args.steps,
                         retention=None, tick_every=args.tick_every)
        kept = simulate(Path(tmp) / "kept.db", agents=args.agents, steps=args.steps,
                        retention=Retention(cfg), tick_every=args.tick_every)
    b_rank = per_row(plain, "rank_steps")
    b_roll = per_row(kept, "rank_rollups")
    b_batch = per_row(kept, "step_batches")
    b_agg = per_row(plain, "step_aggregates")
    b_keys = per_row(plain, "ingested_batches")
    day = {
        "rank_steps": (FULL_RANKS * DAY_STEPS, b_rank, 0.0),
        "rank_rollups": (0.0, b_roll, FULL_RANKS * DAY_STEPS / cfg.bucket_steps),
        "step_batches": (0.0, b_batch, DAY_STEPS),
        "step_aggregates": (DAY_STEPS, b_agg, DAY_STEPS),
        "ingested_batches": (FULL_AGENTS * DAY_STEPS, b_keys, 0.0),
    }
    print(f"\nslice: {args.agents} agents x {RANKS_PER_AGENT} ranks = {ranks} ranks, "
          f"{args.steps} steps; retention keep_steps={cfg.keep_steps} "
          f"bucket_steps={cfg.bucket_steps}, a tick every {args.tick_every} steps")
    print(f"written in {plain['wall_s']:.1f} s without retention, {kept['wall_s']:.1f} s with; "
          f"rows at the end: without {plain['rows']}, with {kept['rows']}")
    print(f"\nper day at {FULL_RANKS:,} ranks ({FULL_AGENTS:,} agents, {DAY_STEPS:,} steps):")
    print("| table | bytes/row | rows/day without | GB/day without | rows/day with | "
          "GB/day with |")
    print("|---|---:|---:|---:|---:|---:|")
    tot_plain = tot_kept = 0.0
    for t, (n_plain, b, n_kept) in day.items():
        tot_plain += n_plain * b
        tot_kept += n_kept * b
        print(f"| {t} | {b:.1f} | {n_plain:,.0f} | {n_plain * b / 1e9:.2f} | {n_kept:,.0f} | "
              f"{n_kept * b / 1e9:.2f} |")
    print(f"| **total** | | | **{tot_plain / 1e9:.1f}** | | **{tot_kept / 1e9:.2f}** |")
    window = cfg.keep_steps * FULL_RANKS * b_rank
    keys = cfg.batch_keys_kept * FULL_AGENTS * b_keys
    print(f"\nwith retention, constant (not per day): the kept window {cfg.keep_steps} steps x "
          f"{FULL_RANKS:,} ranks x {b_rank:.1f} B = {window / 1e9:.2f} GB; the batch keys "
          f"{cfg.batch_keys_kept} x {FULL_AGENTS:,} agents x {b_keys:.1f} B = {keys / 1e9:.2f} GB")
    expect = b_agg + b_batch + ranks * b_roll / cfg.bucket_steps
    print(f"file growth over the second half of the slice ({ranks} ranks): without retention "
          f"{plain['growth_per_step']:.0f} B per step, with {kept['growth_per_step']:.0f} B per "
          f"step (what the per-step aggregates, batch indexes and rollups add: {expect:.0f} B: "
          f"the deleted rows' pages are reused); files at the end: {plain['file'] / 1e6:.1f} MB "
          f"and {kept['file'] / 1e6:.1f} MB")
    return tot_plain / 1e9, tot_kept / 1e9


def rss_report(args: argparse.Namespace) -> float:
    import httpx
    import psutil

    from trainwarden.supervisor.control.retention import RetentionConfig

    with tempfile.TemporaryDirectory(prefix="rollup-rss-") as tmp:
        port_file = Path(tmp) / "port"
        db_url = f"sqlite:///{tmp}/sup.db"
        env = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": TOKEN,
               "TRAINWARDEN_OPERATOR_TOKEN": OP_TOKEN,
               "TRAINWARDEN_MAX_BODY_BYTES": str(8 * 1024 * 1024),
               "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        cmd = [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor", "--db", db_url,
               "--port", "0", "--port-file", str(port_file), "--log-level", "warning"]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env)
        try:
            deadline = time.monotonic() + 60
            while not port_file.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("supervisor did not start")
                time.sleep(0.05)
            port = int(port_file.read_text())
            ps = psutil.Process(proc.pid)
            peak = 0.0
            t = time.perf_counter()
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                r = c.post("/api/v1/agents/register",
                           json={"run": "rss", "node": "n0", "hostname": "h", "pid": 1,
                                 "command": ["torchrun"], "nproc_per_node": RANKS_PER_AGENT})
                r.raise_for_status()
                reg = r.json()
                hdr = {"X-Trainwarden-Agent-Credential": str(reg.get("credential") or ""),
                       "content-type": "application/json"}
                seq = int(reg["next_seq"])
                for lo in range(0, args.rss_steps, args.rss_batch):
                    now = time.time()
                    items: list[dict[str, Any]] = []
                    for s in range(lo, min(args.rss_steps, lo + args.rss_batch)):
                        items += step_items(0, s, now)
                    items.append({"type": "heartbeat", "t": now, "attempt": 0,
                                  "state": "running"})
                    body = json.dumps({"agent_id": reg["agent_id"], "seq": seq, "sent_at": now,
                                       "attempt": 0, "items": items})
                    r = c.post("/api/v1/ingest", content=body, headers=hdr)
                    r.raise_for_status()
                    seq += 1
                    if seq % 50 == 0:
                        peak = max(peak, ps.memory_info().rss / 2**20)
                # The evaluator ticks twice a second: wait until retention has caught up
                # (the kept window starts keep_steps before the newest step), 60 s at most.
                kept_from = None
                want = args.rss_steps - RetentionConfig().keep_steps
                until = time.monotonic() + 60
                while time.monotonic() < until:
                    got = c.get("/api/v1/runs/rss/rank-rollups", params={"rank": 0, "limit": 1},
                                headers={"Authorization": f"Bearer {OP_TOKEN}"})
                    got.raise_for_status()
                    kept_from = got.json()["kept_from_step"]
                    if kept_from is not None and kept_from >= want:
                        break
                    time.sleep(0.5)
                rss = ps.memory_info().rss / 2**20
                peak = max(peak, rss)
                size = sum(p.stat().st_size for p in Path(tmp).glob("sup.db*"))
            wall = time.perf_counter() - t
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"\nsupervisor RSS after {args.rss_steps:,} steps of {RANKS_PER_AGENT} ranks "
          f"({args.rss_steps * RANKS_PER_AGENT:,} rank-steps, {args.rss_batch} steps a batch, "
          f"{wall:.0f} s, retention on): {rss:.0f} MB at the end, {peak:.0f} MB peak "
          f"(goal < {GOAL_RSS_MB:.0f} MB); store at the end {size / 1e6:.1f} MB, per-rank "
          f"rows kept from step {kept_from}")
    print("   supervisor command: TRAINWARDEN_AGENT_TOKEN=... " + shlex.join(cmd[1:]))
    return rss


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--agents", type=int, default=8, help="agents of 8 ranks in the slice")
    ap.add_argument("--steps", type=int, default=6000, help="steps of the slice")
    ap.add_argument("--keep-steps", type=int, default=1000)
    ap.add_argument("--bucket-steps", type=int, default=1000)
    ap.add_argument("--tick-every", type=int, default=10,
                    help="simulated steps between two retention ticks")
    ap.add_argument("--rss-steps", type=int, default=100_000)
    ap.add_argument("--rss-batch", type=int, default=50, help="steps per load-generator batch")
    ap.add_argument("--skip-rss", action="store_true")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny slice and 2,000 RSS steps: checks that it runs")
    args = ap.parse_args()
    if args.smoke:
        args.agents, args.steps, args.keep_steps, args.bucket_steps = 1, 700, 300, 100
        args.rss_steps = 2000
    print("command: " + shlex.join([Path(sys.executable).name, *sys.argv]))
    plain, kept = bytes_report(args)
    ok = kept < GOAL_GB_PER_DAY
    if not args.skip_rss:
        ok = rss_report(args) < GOAL_RSS_MB and ok
    print(f"\nstore GB/day at {FULL_RANKS:,} ranks: {plain:.1f} without retention, {kept:.2f} "
          f"with (goal < {GOAL_GB_PER_DAY:g}): {'met' if kept < GOAL_GB_PER_DAY else 'NOT met'}")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())

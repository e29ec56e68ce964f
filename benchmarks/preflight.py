"""What the workers' preflight health check costs: examples/train_ddp.py for one step under a
real torchrun (gloo on CPU by default), several times, reading each worker's ``preflight``
event from a stand-in for the agent's socket.

    .venv/bin/python benchmarks/preflight.py [--runs 3 --nproc 2]

Prints, per run and rank, the preflight's total seconds and each check's, then the median
and the largest total over all workers.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def collect(path: str, out: list[dict[str, Any]], stop: threading.Event) -> None:
    """Keep every preflight event sent to the socket at ``path`` until ``stop``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.05)
    while not stop.is_set():
        try:
            data = sock.recv(70_000)
        except (TimeoutError, OSError):
            continue
        for line in data.split(b"\n"):
            msg = json.loads(line) if line.strip() else {}
            if msg.get("type") == "event" and msg.get("name") == "preflight":
                out.append(msg)
    sock.close()


def one_run(nproc: int, workdir: Path) -> list[dict[str, Any]]:
    path = str(workdir / "agent.sock")
    events: list[dict[str, Any]] = []
    stop = threading.Event()
    thread = threading.Thread(target=collect, args=(path, events, stop), daemon=True)
    thread.start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}
    env.update(OMP_NUM_THREADS="1", TRAINWARDEN_AGENT_SOCKET=path)
    cmd = [TORCHRUN, f"--nproc_per_node={nproc}", "--standalone", "--monitor-interval=0.1",
           str(REPO / "examples" / "train_ddp.py"), "--steps", "1", "--hidden", "16",
           "--checkpoint-dir", str(workdir / "ck")]
    try:
        proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True,
                              timeout=300)
    finally:
        stop.set()
        thread.join()
    if proc.returncode != 0:
        sys.exit(f"torchrun failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    if len(events) != nproc:
        sys.exit(f"expected {nproc} preflight events, got {len(events)}")
    return sorted(events, key=lambda m: m["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3, help="torchrun runs")
    ap.add_argument("--nproc", type=int, default=2, help="workers per run")
    args = ap.parse_args()
    import torch

    print(f"preflight: {args.runs} runs x {args.nproc} workers of examples/train_ddp.py; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"CUDA {'available' if torch.cuda.is_available() else 'not available'}\n")
    print("| run | rank | passed | total (s) | devices (s) | compute (s) | allreduce (s) |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    totals: list[float] = []
    for run in range(1, args.runs + 1):
        with tempfile.TemporaryDirectory(prefix="preflight-bench-") as tmp:
            for ev in one_run(args.nproc, Path(tmp)):
                d = ev["details"]
                secs = {c["name"]: c["seconds"] for c in d["checks"]}
                totals.append(d["seconds"])
                print(f"| {run} | {ev['rank']} | {d['passed']} | {d['seconds']:.3f} | "
                      f"{secs['devices']:.4f} | {secs['compute']:.4f} | "
                      f"{secs['allreduce']:.4f} |")
    print(f"\ntotal per worker: median {statistics.median(totals):.3f} s, "
          f"largest {max(totals):.3f} s")


if __name__ == "__main__":
    main()

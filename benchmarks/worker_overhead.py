"""Worker-side cost of trainwarden's in-training reporting, measured A/B in one run.

The same tiny training loop (a 2-layer MLP, AdamW, one thread) runs in interleaved blocks:
  A: plain loop;
  B: the same loop plus a PhaseTimer and report_step() to a live agent socket (a separate
     process drains it, as the real agent does);
  C: like B but with no agent listening (the report is dropped and counted).
Blocks alternate (A B C, C B A, ...) so drift of the machine hits all three alike.

    .venv/bin/python benchmarks/worker_overhead.py [--blocks 60 --steps 100]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from trainwarden.agent.worker.report import PhaseTimer, Reporter, report_step, set_reporter

DRAIN = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    s.recv(65536)
"""


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=60, help="rounds of A, B, C blocks")
    ap.add_argument("--steps", type=int, default=100, help="steps per block")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 32), torch.randn(32, 8)

    tmp = Path(tempfile.mkdtemp())
    path = str(tmp / "agent.sock")
    drain = subprocess.Popen([sys.executable, "-c", DRAIN, path], stdout=subprocess.PIPE,
                             text=True)
    assert drain.stdout is not None and drain.stdout.readline().strip() == "ready"
    live = Reporter(path, rank=0, local_rank=0, world_size=1)
    absent = Reporter(str(tmp / "nobody.sock"), rank=0, local_rank=0, world_size=1)

    step_times: dict[str, list[float]] = {"A": [], "B": [], "C": []}
    block_medians: dict[str, list[float]] = {"A": [], "B": [], "C": []}
    call_us: dict[str, list[float]] = {"B": [], "C": []}
    timer = PhaseTimer()

    def block(kind: str) -> None:
        set_reporter(live if kind == "B" else absent)
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            if kind != "A":
                timer.start()
                timer.data_ready()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if kind != "A":
                timer.compute_done()
            opt.step()
            opt.zero_grad(set_to_none=True)
            lv = loss.item()
            if kind != "A":
                timer.stop()
                c0 = time.perf_counter()
                report_step(i, loss=lv, samples=32, lr=1e-3, timer=timer, batch_index=i)
                call_us[kind].append((time.perf_counter() - c0) * 1e6)
            times.append(time.perf_counter() - t0)
        step_times[kind].extend(times)
        block_medians[kind].append(statistics.median(times))

    for kind in "ABC":  # warm-up
        block(kind)
    for k in step_times.values():
        k.clear()
    for k in block_medians.values():
        k.clear()
    for v in call_us.values():
        v.clear()
    for b in range(args.blocks):
        for kind in ("ABC" if b % 2 == 0 else "CBA"):
            block(kind)
    drain.kill()
    set_reporter(None)

    med = {k: statistics.median(v) for k, v in step_times.items()}
    # Overhead: per round, the variant's median step over plain A's in the same round; the
    # median of those ratios is robust to the machine's drift and to other load.
    ratio = {k: statistics.median(b / a for a, b in zip(block_medians["A"], block_medians[k],
                                                         strict=True)) - 1.0 for k in "ABC"}
    print(f"worker overhead: {args.blocks} rounds x {args.steps} steps per variant, "
          f"interleaved; torch {torch.__version__}, {os.cpu_count()} CPUs")
    print("overhead vs A = median over rounds of (variant's median step / A's median step) - 1")
    print()
    print("| variant | median step (µs) | p99 step (µs) | report_step p50 (µs) "
          "| report_step p99 (µs) | overhead vs A |")
    print("|---|---:|---:|---:|---:|---:|")
    names = {"A": "A: plain loop", "B": "B: timer + report_step, agent listening",
             "C": "C: timer + report_step, no agent (dropped)"}
    for k in "ABC":
        p50 = f"{percentile(call_us[k], 0.5):.1f}" if k in call_us else "-"
        p99 = f"{percentile(call_us[k], 0.99):.1f}" if k in call_us else "-"
        print(f"| {names[k]} | {med[k] * 1e6:.0f} | {percentile(step_times[k], 0.99) * 1e6:.0f} "
              f"| {p50} | {p99} | {ratio[k] * 100:+.2f}% |")
    print()
    per_call_share = percentile(call_us["B"], 0.5) / (med["A"] * 1e6) * 100
    print(f"report_step p50 as a share of the plain step: {per_call_share:.2f}% "
          f"(target < 1%); sent {live.sent}, dropped {live.dropped} (live agent); "
          f"dropped {absent.dropped} (no agent)")


if __name__ == "__main__":
    main()

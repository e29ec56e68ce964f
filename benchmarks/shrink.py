"""Shrinking instead of waiting for a node, in the simulated large run: ETTR of Llama 3 405B's
54 days on 16,384 GPUs (2,048 nodes of 8) with no spare free, a run that waits for each lost
node against one that restarts on the nodes left and grows back when the node returns, for
several return times.

What comes from where:

* Failure schedule, node-lost deadline, step, saves, checkpoint interval and restart times:
  as ``benchmarks/spares.py`` (Llama 3's 419 interruptions in 54 days, 78% of them hardware,
  each a node that died for good; the measured restart, 6.2 s, and an assumed 5 minutes).
  No spares: every node loss finds none free, and its node returns ``--return-min`` after the
  detection (``SimConfig.replace_s``).
* Shrinking (``SimConfig.min_nodes``): the gang restarts at once on the nodes left.  A lost
  node takes its data-parallel replica out of the world: Llama 3 405B trained on 16,384 GPUs
  with tensor parallelism 8 and pipeline parallelism 16, so a replica is 128 GPUs, 16 nodes
  (Dubey et al. 2024, Table 4; ``--replica-nodes``).  The global batch is kept (each replica
  does more micro-batches), so a step on n of N nodes takes N / n as long (an assumption:
  perfect scaling; ``--efficiency`` below 1 slows it further); the time beyond the full
  world's step is the ``capacity`` badput.  The run accepts down to ``--min-nodes`` (1,792:
  112 of 128 replicas); below it a loss waits as the waiting run does.  When the node
  returns, the run grows back at its next checkpoint: a planned restart (counted in
  ``restart``) once that checkpoint is written, one restart time.
* "model": ``trainwarden.supervisor.goodput.elastic.choose`` for one loss at each return
  time (the grow back half a checkpoint interval after the return, on average): the
  expected training lost waiting and shrinking, and its choice.

Each cell is ``trainwarden.supervisor.goodput.simulate`` (deterministic for its seed; the
cells of a seed draw the same faults) accounted by the supervisor's ``EttrAccumulator``.

    .venv/bin/python benchmarks/shrink.py --json /tmp/shrink.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import goodput_scaled as gs  # noqa: E402  (benchmarks/ is the script's directory)
import spares as sp  # noqa: E402

from trainwarden.supervisor.goodput.elastic import NodeLoss, choose  # noqa: E402
from trainwarden.supervisor.goodput.simulate import SimConfig, simulate  # noqa: E402

NODES = sp.NODES
REPLICA_NODES = 128 // gs.GPUS_PER_NODE  # Llama 3 405B: TP 8 x PP 16 GPUs per replica
MIN_NODES = NODES - 16 * REPLICA_NODES  # 112 of 128 replicas
BADPUT = ("capacity", "restart", "detection", "lost", "checkpoint", "other")


@dataclass
class Cell:
    seed: int
    restart: str  # "measured" | "5 min"
    mode: str  # "wait" | "shrink" | "node at hand"
    return_s: float
    interval_s: float
    ettr: float | None
    badput: dict[str, float]  # share of wall time per part
    grow_share: float  # of wall time: the planned restarts back to the full world
    node_losses: int
    waits: int
    shrinks: int
    grows: int
    fewest_nodes: int | None
    seconds: float


def run_cell(mode: str, return_s: float, *, seed: int, restart_s: float | None,
             args: argparse.Namespace) -> Cell:
    kinds = sp.fault_kinds(args.step_s, restart_s)
    write = gs.write_seconds(sp.GPUS)
    dt = args.interval_s or sp.interval_for(kinds, step_s=args.step_s, stall_s=args.stall_s,
                                            write_s=write)
    cfg = SimConfig(mtbf_s=sp.MTBF_S, days=args.days, step_s=args.step_s, interval_s=dt,
                    stall_s=args.stall_s, kinds=kinds, seed=seed, write_s=write, spares=0,
                    replace_s=return_s, nodes=NODES, replica_nodes=args.replica_nodes,
                    min_nodes=args.min_nodes if mode == "shrink" else None,
                    shrink_efficiency=args.efficiency)
    t0 = time.monotonic()
    r = simulate(cfg)
    b, n = r.breakdown, r.nodes
    return Cell(seed, "measured" if restart_s is None else f"{restart_s / 60:g} min", mode,
                return_s, dt, b.ettr, {p: getattr(b, p) / b.wall_s for p in BADPUT},
                n.grow_s / b.wall_s, n.losses, n.waits, n.shrinks, n.grows, n.fewest_nodes,
                time.monotonic() - t0)


def verdict(return_s: float, restart_s: float, interval_s: float,
            args: argparse.Namespace) -> str:
    """``elastic.choose`` for one loss: its choice and the expected seconds lost each way."""
    c = choose(NodeLoss(nodes=NODES, live_nodes=NODES - args.replica_nodes,
                        min_nodes=args.min_nodes, step_s=args.step_s, restart_s=restart_s,
                        to_checkpoint_s=interval_s / 2, return_s=return_s,
                        efficiency=args.efficiency))
    return f"{c.choice} ({c.wait_s:.0f} s / {c.shrink_s:.0f} s)"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _pct2(x: float) -> str:
    return f"{100 * x:.2f}%"  # (capacity is a small share: one replica of 128)


def _ret(s: float) -> str:
    return "-" if s == 0 else f"{s / 60:g} min" if s < 3600 else f"{s / 3600:g} h"


def table(rows: list[tuple[str, float, list[Cell]]], seeds: list[int], restart: str,
          args: argparse.Namespace) -> list[str]:
    per = " / ".join(str(s) for s in seeds)
    lines = [f"| node back after | run | ETTR (seeds {per}) | "
             + " | ".join(BADPUT) + " | of restart: grow back | node losses | waited | "
             "shrank | grew back | fewest nodes | model: choice (s lost waiting / shrinking) |",
             "|---:|---|---:|" + "---:|" * (len(BADPUT) + 6) + "---|"]
    for mode, ret, cells in rows:
        cs = [c for c in cells if c.restart == restart]
        if not cs:
            continue

        def mean(f: str, cs: list[Cell] = cs) -> float:
            return sum(c.badput[f] for c in cs) / len(cs)

        restart_s = gs.MEASURED["crash"][1] if restart == "measured" else sp.SLOW_RESTART_S
        model = verdict(ret, restart_s, cs[0].interval_s, args) if mode == "shrink" else ""
        fewest = " / ".join("-" if c.fewest_nodes is None else f"{c.fewest_nodes:,}"
                            for c in cs)
        lines.append(
            f"| {_ret(ret)} | {mode} | " + " / ".join(_pct(c.ettr) for c in cs) + " | "
            + " | ".join(_pct2(mean(p)) for p in BADPUT) + " | "
            + _pct2(sum(c.grow_share for c in cs) / len(cs)) + " | "
            + " / ".join(str(c.node_losses) for c in cs) + " | "
            + " / ".join(str(c.waits) for c in cs) + " | "
            + " / ".join(str(c.shrinks) for c in cs) + " | "
            + " / ".join(str(c.grows) for c in cs) + f" | {fewest} | {model} |")
    return lines


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--days", type=float, default=54.0,
                    help="simulated run time (default 54, Llama 3's)")
    ap.add_argument("--step-s", type=float, default=6.0, help="the large run's step (6 s)")
    ap.add_argument("--stall-s", type=float, default=0.17,
                    help="training stall per asynchronous save (0.17 s, as spares.py)")
    ap.add_argument("--interval-s", type=float, default=0.0,
                    help="checkpoint interval (default 0: the recommended one)")
    ap.add_argument("--return-min", type=_floats, default=[1.0, 5.0, 10.0, 60.0, 240.0],
                    help="minutes until a lost node's replacement arrives, comma-separated "
                         "(1,5,10,60,240)")
    ap.add_argument("--min-nodes", type=int, default=MIN_NODES,
                    help=f"the smallest world the shrinking run accepts ({MIN_NODES:,})")
    ap.add_argument("--replica-nodes", type=int, default=REPLICA_NODES,
                    help=f"nodes a lost node takes out of the world ({REPLICA_NODES}: a "
                         "data-parallel replica of Llama 3 405B)")
    ap.add_argument("--efficiency", type=float, default=1.0,
                    help="a shrunk world's throughput per node against the full world's (1)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 3], help="fault draws, comma-separated (1,2,3)")
    ap.add_argument("--json", help="write every cell here")
    args = ap.parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/shrink.py", *sys.argv[1:]])
    print(f"# command: {command}\n# {args.days:g} simulated days, {sp.GPUS:,} GPUs = "
          f"{NODES:,} nodes, MTBF {sp.MTBF_S / sp.HOUR_S:.2f} h, node-lost deadline "
          f"{sp.node_lost_s():g} s; {os.cpu_count()} CPUs", flush=True)
    t0 = time.monotonic()
    plan = [("node at hand", 0.0)] + [(mode, m * 60.0) for m in args.return_min
                                      for mode in ("wait", "shrink")]
    rows: list[tuple[str, float, list[Cell]]] = []
    for mode, ret in plan:
        cells = [run_cell(mode, ret, seed=seed, restart_s=restart, args=args)
                 for restart in (None, sp.SLOW_RESTART_S) for seed in args.seeds]
        rows.append((mode, ret, cells))
        print(f"  {mode}, node back after {_ret(ret)}: "
              + ", ".join(f"{c.restart} s{c.seed} {_pct(c.ettr)}" for c in cells)
              + f" ({sum(c.seconds for c in cells):.0f} s)", flush=True)
    kinds = sp.fault_kinds(args.step_s, None)
    intervals = sorted({c.interval_s for _, _, cells in rows for c in cells})
    out = [f"## Shrink or wait ({args.days:g} simulated days, {sp.GPUS:,} GPUs = {NODES:,} "
           "nodes, no spare)", "", f"Command: `{command}`", "",
           f"Llama 3's schedule: one interruption every {sp.MTBF_S / sp.HOUR_S:.2f} h of "
           "training, " + ", ".join(f"{k.name} {100 * k.share:.1f}%" for k in kinds)
           + f"; checkpoint every {' / '.join(f'{x:.0f} s' for x in intervals)} (measured / "
           f"5-min restart), background write {gs.write_seconds(sp.GPUS):.1f} s. Shrinking: "
           f"a lost node takes {args.replica_nodes} nodes out, down to {args.min_nodes:,}, "
           f"efficiency {args.efficiency:g}. Badput: mean of the seeds, % of wall time "
           "(restart includes the wait for a node and the grow back).", ""]
    for restart in ("measured", f"{sp.SLOW_RESTART_S / 60:g} min"):
        out += [f"Restart {restart}:", "", *table(rows, args.seeds, restart, args), ""]
    out += [f"Simulated in {time.monotonic() - t0:.0f} s."]
    print()
    print("\n".join(out))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": command, "mtbf_s": sp.MTBF_S, "kinds": [asdict(k) for k in kinds],
             "rows": [{"mode": m, "return_s": r, "cells": [asdict(c) for c in cells]}
                      for m, r, cells in rows]}, indent=1))


if __name__ == "__main__":
    main()

"""Warm spare nodes in the simulated large run: ETTR of Llama 3 405B's 54 days on 16,384 GPUs
(2,048 nodes of 8) with 0, 1 and 2% of the nodes as spares.

What comes from where:

* Failure schedule: Llama 3 405B, 419 unexpected interruptions in 54 days (Dubey et al.
  2024), a Poisson process; 78% of them hardware (``LLAMA3_HARDWARE_SHARE``, the same
  paper), each taken here as a node that died for good and needs a replacement node.  The
  other 22% split as ``benchmarks/goodput_scaled.py``'s mix (80% crash, 17% hang, 3% loss
  spike; an assumption) and restart on the same nodes.
* A node loss is detected at the node-lost deadline the supervisor uses for 2,048 agents
  (``lost_deadline`` at the batch interval ``advised_batch_interval`` asks of them), then
  the gang restarts from the newest checkpoint at the same world size once a node takes the
  dead one's rank: a free spare at once; with none free, a node from outside the pool after
  ``--replace-h`` or a repaired one rejoining, whichever comes first.  A dead node swapped
  for a spare rejoins the spares ``--repair-days`` later (``SimConfig``'s node model).
* Restart (decision to the first step), as ``goodput_scaled.py``: this machine's measured
  times per kind (a node loss restarts as a crash does: 6.2 s), and an assumed 5 minutes
  for every kind (a large job's rendezvous and multi-TB checkpoint load; not measured here).
* The run, as ``goodput_scaled.py``'s 16,384-GPU rows: 6 s steps, asynchronous saves staging
  ``--stall-s`` (0.17 s: the stall ``goodput.py --scaled`` measured and fitted at this
  scale's 346 MB shard, benchmarks/results/2026-12-05-goodput-scaled.md) and written in the
  background at a node's share of Llama 3's storage, a checkpoint every recommended interval
  (``interval.optimal_interval`` for the kinds' detection and restart; the wait for a node
  is not work lost, so it is left out).

Each row is ``trainwarden.supervisor.goodput.simulate`` (deterministic for its seed; every
row of a seed draws the same faults) accounted by the supervisor's ``EttrAccumulator``.

    .venv/bin/python benchmarks/spares.py --json /tmp/spares.json
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

from trainwarden.supervisor.control.detection import DetectionConfig, lost_deadline  # noqa: E402
from trainwarden.supervisor.control.policy import advised_batch_interval  # noqa: E402
from trainwarden.supervisor.detect.overload import OverloadConfig  # noqa: E402
from trainwarden.supervisor.goodput import interval as iv  # noqa: E402
from trainwarden.supervisor.goodput.simulate import (  # noqa: E402
    LLAMA3_HARDWARE_SHARE,
    FaultKind,
    SimConfig,
    simulate,
    with_node_losses,
)

GPUS = 16384
NODES = GPUS // gs.GPUS_PER_NODE
MTBF_S = iv.DAY_S / (NODES * iv.LLAMA3_PER_NODE_DAY)  # Llama 3: 419 in 54 days, whole job
SLOW_RESTART_S = 300.0  # goodput_scaled.py's assumed large-job restart
HOUR_S = 3600.0


def node_lost_s(nodes: int = NODES) -> float:
    """The supervisor's node-lost deadline for a run of ``nodes`` agents at default settings."""
    every = advised_batch_interval(last_overloaded_at=None, now=0.0, sending_agents=nodes,
                                   cfg=OverloadConfig())
    return lost_deadline(DetectionConfig(), every).deadline_s


def fault_kinds(step_s: float, restart_s: float | None) -> tuple[FaultKind, ...]:
    """Node losses (78%) beside goodput_scaled.py's kinds; ``restart_s`` None: measured."""
    return with_node_losses(gs.kinds(step_s, restart_s), detect_s=node_lost_s(),
                            restart_s=restart_s or gs.MEASURED["crash"][1],
                            share=LLAMA3_HARDWARE_SHARE)


def interval_for(kinds: tuple[FaultKind, ...], *, step_s: float, stall_s: float,
                 write_s: float) -> float:
    u0 = sum(k.share * (k.detect_s + k.restart_s) for k in kinds)
    dt = iv.optimal_interval(mtbf_s=MTBF_S, restart_s=u0 + write_s, save_stall_s=stall_s)
    return max(step_s, write_s, dt if dt is not None else step_s)


@dataclass(frozen=True)
class Case:
    label: str  # what the row varies
    spares: int | None  # None: a node always at hand (no wait, the bound)
    replace_s: float
    repair_s: float


@dataclass
class Cell:
    seed: int
    restart: str  # "measured" | "5 min"
    interval_s: float
    ettr: float | None
    faults: int
    node_losses: int
    waits: int
    wait_share: float  # of wall time
    from_outside: int
    fewest_free: int | None
    seconds: float


def spare_count(pct: float) -> int:
    return round(NODES * pct / 100)


def cases(args: argparse.Namespace) -> list[Case]:
    """The bound (a node always at hand), each spare share at the default replacement and
    repair times, then the sensitivity rows."""
    rep, fix = args.replace_h * HOUR_S, args.repair_days * iv.DAY_S
    pools = [(f"{pct:g}% ({spare_count(pct)})", spare_count(pct)) for pct in args.spares_pct]
    out = [Case("a node always at hand", None, 0.0, 0.0)]
    out += [Case(label, n, rep, fix) for label, n in pools]
    out += [Case(label, n, h * HOUR_S, fix) for h in args.replace_h_also for label, n in pools]
    # (with no spares the repair time plays no part)
    out += [Case(label, n, rep, d * iv.DAY_S) for d in args.repair_days_also
            for label, n in pools if n > 0]
    return out


def run_cell(case: Case, *, seed: int, restart_s: float | None,
             args: argparse.Namespace) -> Cell:
    kinds = fault_kinds(args.step_s, restart_s)
    write = gs.write_seconds(GPUS)
    dt = args.interval_s or interval_for(kinds, step_s=args.step_s, stall_s=args.stall_s,
                                         write_s=write)
    cfg = SimConfig(mtbf_s=MTBF_S, days=args.days, step_s=args.step_s, interval_s=dt,
                    stall_s=args.stall_s, kinds=kinds, seed=seed, write_s=write,
                    spares=case.spares or 0, replace_s=case.replace_s,
                    repair_s=case.repair_s)
    t0 = time.monotonic()
    r = simulate(cfg)
    return Cell(seed, "measured" if restart_s is None else f"{restart_s / 60:g} min", dt,
                r.breakdown.ettr, sum(r.faults.values()), r.nodes.losses, r.nodes.waits,
                r.nodes.wait_s / r.breakdown.wall_s, r.nodes.from_outside,
                r.nodes.fewest_free if case.spares is not None else None,
                time.monotonic() - t0)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(rows: list[tuple[Case, list[Cell]]], seeds: list[int]) -> list[str]:
    per = " / ".join(str(s) for s in seeds)
    lines = [f"| spares | node from outside | repair | node losses | restarts that waited for "
             f"a node | time waiting for a node | fewest spares free | ETTR, measured restart "
             f"(seeds {per}) | ETTR, 5-min restart (seeds {per}) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case, cells in rows:
        meas = [c for c in cells if c.restart == "measured"]
        slow = [c for c in cells if c.restart != "measured"]
        if case.spares is None:
            rep = fix = "-"
        else:
            rep = f"{case.replace_s / HOUR_S:g} h"
            fix = f"{case.repair_s / iv.DAY_S:g} days" if case.spares else "-"
        lines.append(
            f"| {case.label} | {rep} | {fix} | "
            + " / ".join(str(c.node_losses) for c in meas) + " | "
            + " / ".join(str(c.waits) for c in meas) + " | "
            + " / ".join(_pct(c.wait_share) for c in meas) + " | "
            + " / ".join("-" if c.fewest_free is None else str(c.fewest_free) for c in meas)
            + " | "
            + " / ".join(_pct(c.ettr) for c in meas) + " | "
            + " / ".join(_pct(c.ettr) for c in slow) + " |")
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
                    help="training stall per asynchronous save (0.17 s: goodput.py --scaled's "
                         "measured staging at 16,384 GPUs)")
    ap.add_argument("--interval-s", type=float, default=0.0,
                    help="checkpoint interval (default 0: the recommended one)")
    ap.add_argument("--spares-pct", type=_floats, default=[0.0, 1.0, 2.0],
                    help="spares as %% of the 2,048 nodes, comma-separated (0,1,2)")
    ap.add_argument("--replace-h", type=float, default=4.0,
                    help="hours for a node from outside the pool when no spare is free (4)")
    ap.add_argument("--repair-days", type=float, default=2.0,
                    help="days before a dead node swapped for a spare rejoins the spares (2)")
    ap.add_argument("--replace-h-also", type=_floats, default=[1.0, 24.0],
                    help="sensitivity rows: other replacement times in hours (1,24)")
    ap.add_argument("--repair-days-also", type=_floats, default=[7.0],
                    help="sensitivity rows: other repair times in days (7)")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")],
                    default=[1, 2, 3], help="fault draws, comma-separated (1,2,3)")
    ap.add_argument("--json", help="write every cell here")
    args = ap.parse_args()
    command = shlex.join([".venv/bin/python", "benchmarks/spares.py", *sys.argv[1:]])
    print(f"# command: {command}\n# {args.days:g} simulated days, {GPUS:,} GPUs = {NODES:,} "
          f"nodes, MTBF {MTBF_S / HOUR_S:.2f} h, node-lost deadline {node_lost_s():g} s; "
          f"{os.cpu_count()} CPUs", flush=True)
    t0 = time.monotonic()
    rows: list[tuple[Case, list[Cell]]] = []
    for case in cases(args):
        cells = [run_cell(case, seed=seed, restart_s=restart, args=args)
                 for restart in (None, SLOW_RESTART_S) for seed in args.seeds]
        rows.append((case, cells))
        print(f"  {case.label}, outside {case.replace_s / HOUR_S:g} h, repair "
              f"{case.repair_s / iv.DAY_S:g} d: "
              + ", ".join(f"{c.restart} s{c.seed} {_pct(c.ettr)}" for c in cells)
              + f" ({sum(c.seconds for c in cells):.0f} s)", flush=True)
    kinds = fault_kinds(args.step_s, None)
    # With no spare every node loss waits the whole replacement time (the fault clock runs
    # while training only), so the bound is stretched by that wait per MTBF of training.
    bound = [c.ettr or 0.0 for c in rows[0][1] if c.restart == "measured"]
    at_hand = sum(bound) / len(bound)
    no_spare = [(case.replace_s, at_hand / (1 + LLAMA3_HARDWARE_SHARE * case.replace_s / MTBF_S))
                for case, _ in rows if case.spares == 0]
    intervals = sorted({c.interval_s for _, cells in rows for c in cells})
    out = [f"## Spares ({args.days:g} simulated days, {GPUS:,} GPUs = {NODES:,} nodes)", "",
           f"Command: `{command}`", "",
           f"Llama 3's schedule: one interruption every {MTBF_S / HOUR_S:.2f} h of training, "
           + ", ".join(f"{k.name} {100 * k.share:.1f}% (detected in {k.detect_s:.1f} s, "
                       f"restart {k.restart_s:.1f} s)" for k in kinds)
           + f"; checkpoint every {' / '.join(f'{x:.0f} s' for x in intervals)} "
           f"(recommended, measured / 5-min restart), stall {args.stall_s:g} s, background "
           f"write {gs.write_seconds(GPUS):.1f} s. Cells: seeds "
           + " / ".join(str(s) for s in args.seeds) + "; node losses to fewest spares free: "
           "the measured-restart runs.", "", *table(rows, args.seeds), "",
           "No spare: each node loss waits the whole replacement time, so ETTR ~ ETTR with a "
           f"node always at hand (mean {_pct(at_hand)}) / (1 + {LLAMA3_HARDWARE_SHARE:g} x "
           "replacement / MTBF): "
           + ", ".join(f"{rep / HOUR_S:g} h {_pct(m)}" for rep, m in no_spare) + ".", "",
           f"Simulated in {time.monotonic() - t0:.0f} s."]
    print()
    print("\n".join(out))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": command, "mtbf_s": MTBF_S, "kinds": [asdict(k) for k in kinds],
             "rows": [{"case": asdict(c), "cells": [asdict(x) for x in cells]}
                      for c, cells in rows]}, indent=1))


if __name__ == "__main__":
    main()

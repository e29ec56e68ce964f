"""Loss spikes in real runs under trainwarden: the final held-out loss against a clean run,
the decision taken (transient event or rollback) and the figures the supervisor stated.

Each scenario is one example run under ``trainwarden agent`` (2 ranks, gloo on CPU) against
one ``trainwarden supervisor`` subprocess (SQLite, the default settings except a 0.5 s
restart backoff); runs go one after another.  Per run: the final eval loss (the script's
summary), the restarts, every incident and every ``loss_spike_transient`` event with its
details, the restart anatomy, and the final lineage's loss per step (``--json``).

    .venv/bin/python benchmarks/spike_cost.py --scenarios ddp-clean,ddp-mild --reps 3
    .venv/bin/python benchmarks/spike_cost.py --scenarios hf-clean,hf-spike --json out.json
    .venv/bin/python benchmarks/spike_cost.py --analyse out.json   # both figures, per spike

``--analyse`` reads runs written with ``--json`` and weighs each spike's cost as the policy
does (``goodput.spike_cost``) at the step its verdict was given (an incident's detection, a
transient event's return) on the run's recorded loss curve: the step time measured on the
curve, the restart time the median of the restarts measured in the same file.

Scenarios:

* ``ddp-clean`` / ``ddp-mild`` / ``ddp-spike`` / ``ddp-blip``: ``examples/train_ddp.py``
  400 steps (seed 2, hidden 32, a checkpoint every 50 steps, LR 2e-3), clean, ``--inject
  spike@200:len=1:scale=2``, ``--inject spike@200`` (20 batches, scale 30), and ``--inject
  spike@200:len=1:scale=1`` (one batch with its targets flipped, ``ddp-blip``);
* ``hf-clean`` / ``hf-spike``: ``examples/hf_trainer.py`` 200 steps (a checkpoint every 25
  steps), clean and ``--inject spike@100`` (20 batches).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the helpers live in the repository
    sys.path.insert(0, str(REPO))

from tests.e2e.system import Agent, Supervisor, wait_until  # noqa: E402
from tests.e2e.torchrun import EXAMPLES  # noqa: E402
from trainwarden.supervisor.goodput.spike_cost import progress_lost, weigh  # noqa: E402

DDP = ["--steps", "400", "--hidden", "32", "--seed", "2", "--checkpoint-every-steps", "50",
       "--lr", "2e-3"]
HF = ["--steps", "200", "--seed", "0", "--checkpoint-every-steps", "25"]
SCENARIOS: dict[str, tuple[str, list[str]]] = {
    "ddp-clean": ("train_ddp.py", DDP),
    "ddp-mild": ("train_ddp.py", [*DDP, "--inject", "spike@200:len=1:scale=2"]),
    "ddp-spike": ("train_ddp.py", [*DDP, "--inject", "spike@200"]),
    "ddp-blip": ("train_ddp.py", [*DDP, "--inject", "spike@200:len=1:scale=1"]),
    "hf-clean": ("hf_trainer.py", HF),
    "hf-spike": ("hf_trainer.py", [*HF, "--inject", "spike@100"]),
}
SUPERVISOR_ENV = {"TRAINWARDEN_RESTART_BACKOFF_S": "0.5"}


def one(sup: Supervisor, work: Path, name: str, script: str, args: list[str]) -> dict[str, Any]:
    work.mkdir(parents=True)
    t0 = time.monotonic()
    agent = Agent(sup.url, name, "node0", work, [
        "--nproc_per_node=2", "--standalone", str(EXAMPLES / script), *args,
        "--checkpoint-dir", str(work / "ck"), "--summary-json", str(work / "summary.json")])
    try:
        code = agent.wait(1800)
    finally:
        agent.stop()
    wall = time.monotonic() - t0
    run = wait_until(lambda: (r := sup.get(f"/runs/{name}"))["status"]
                     in ("completed", "failed", "stopped") and r, 30, f"run {name} to end")
    summary = json.loads((work / "summary.json").read_text()) if (
        work / "summary.json").exists() else {}
    incidents = sup.get(f"/runs/{name}/incidents")["incidents"]
    events = [e for e in sup.get(f"/runs/{name}/events")["events"]
              if "spike" in str(e.get("name", ""))]
    actions = sup.get(f"/runs/{name}/actions")["actions"]
    steps = sup.get(f"/runs/{name}/steps?max_points=100000")
    return {"name": name, "agent_exit": code, "status": run["status"],
            "restarts": run["restarts"], "wall_s": wall,
            "final_eval_loss": summary.get("final_eval_loss"),
            "incidents": [{k: i.get(k) for k in ("kind", "step", "cause", "details")}
                          for i in incidents],
            "events": [{k: e.get(k) for k in ("name", "step", "message", "details")}
                       for e in events],
            "actions": [{k: a.get(k) for k in ("cause", "status", "plan", "resumed_step",
                                               "anatomy")} for a in actions],
            "loss": [[p["step_from"], p["loss_mean"], p["t"]] for p in steps["points"]],
            "superseded": [[p["step_from"], p["loss_mean"], p["attempt"]]
                           for p in steps["superseded"]]}


def analyse(path: Path) -> None:
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    restarts = [a["anatomy"]["total_s"] for r in runs for a in r["actions"]
                if a.get("anatomy") and a["anatomy"].get("total_s") is not None]
    restart_s = statistics.median(restarts) if restarts else None
    print(f"restart time, median of {len(restarts)}: {restart_s}")
    print("| run | verdict | spike start | judged at | progress lost: steps (s) | "
          "rollback: to step, steps (s) | cheaper |")
    print("|---|---|---:|---:|---:|---:|---|")
    for r in runs:
        pts = [(int(s), float(x), float(t)) for s, x, t in r["loss"] if x is not None]
        gaps = [(t1 - t0) / (s1 - s0) for (s0, _, t0), (s1, _, t1) in itertools.pairwise(pts)
                if s1 > s0 and t1 >= t0]
        step_s = statistics.median(gaps) if gaps else 0.0
        # The curve the verdict was given on: the first attempt's (a rollback's attempt
        # trained its steps again).
        first = {int(s): float(x) for s, x, a in r["superseded"] if a == 0 and x is not None}
        curve = {s: x for s, x, _ in pts if not first or s < min(first)} | first
        found = [("incident", i["step"], i["details"].get("detected_at_step"))
                 for i in r["incidents"] if i["kind"] == "loss_spike"]
        found += [("transient", e["step"], e["details"].get("recovered_at_step"))
                  for e in r["events"] if e["name"] == "loss_spike_transient"]
        for verdict, start, at in found:
            at = at if at is not None else start
            if verdict == "transient":
                at += 4  # the detector calls it back once 5 steps are back
            hist = [(s, x) for s, x in sorted(curve.items()) if s <= at]
            p = progress_lost(hist, start=start, step_s=step_s)
            ck = ((start - 10) // 50) * 50 if r["scenario"].startswith("ddp") else \
                ((start - 10) // 25) * 25
            if p is None:
                continue
            c = weigh(p, checkpoint_step=ck, skipped_batches=at - (start - 10) + 1,
                      restart_s=restart_s)
            print(f"| {r['name']} | {verdict} | {start} | {at} | {c.lost_steps} "
                  f"({c.lost_s:.2f}) | {ck}, {c.rollback_steps:.0f} ({c.rollback_s:.1f}) | "
                  f"{c.cheaper} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="ddp-clean,ddp-mild,ddp-spike")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="append one line per run here")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--analyse", type=Path, default=None, metavar="JSON",
                    help="only weigh the spikes of runs written with --json")
    args = ap.parse_args()
    if args.analyse is not None:
        analyse(args.analyse)
        return
    names = args.scenarios.split(",")
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(f"unknown scenario(s) {unknown}; known: {sorted(SCENARIOS)}")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="spike-cost-"))
    sup = Supervisor(work / "sup", env=SUPERVISOR_ENV).start()
    results: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for rep in range(args.reps):
            for n in names:
                script, sargs = SCENARIOS[n]
                r = one(sup, work / f"{n}-{rep}", f"{n}-{rep}", script, sargs)
                r["scenario"] = n
                results[n].append(r)
                if args.json is not None:
                    with args.json.open("a") as f:
                        f.write(json.dumps(r) + "\n")
                decided = ([f"incident {i['kind']}@{i['step']}" for i in r["incidents"]]
                           + [f"event {e['name']}@{e['step']}" for e in r["events"]])
                print(f"{n} #{rep}: eval {r['final_eval_loss']}, restarts {r['restarts']}, "
                      f"{r['wall_s']:.0f} s, {', '.join(decided) or 'nothing'}", flush=True)
    finally:
        sup.stop()
    print("\n| scenario | runs | final eval loss: median (range) | restarts |")
    print("|---|---:|---:|---:|")
    for n, rs in results.items():
        ev = [r["final_eval_loss"] for r in rs if r["final_eval_loss"] is not None]
        if ev:
            print(f"| {n} | {len(rs)} | {statistics.median(ev):.4f} ({min(ev):.4f}-"
                  f"{max(ev):.4f}) | {', '.join(str(r['restarts']) for r in rs)} |")


if __name__ == "__main__":
    main()

"""Goodput: one run with a schedule of injected faults beside the same run clean.

Both are real 2-worker ``torchrun`` DDP runs (``examples/train_ddp.py``, gloo on CPU) under one
node agent, against one supervisor subprocess (SQLite, default settings), one after the other
in one invocation.  The faulty run gets, in one attempt after another (each process fault
fires once per run, see ``trainwarden.agent.worker.faults``): a SIGKILL of rank 1, a hang of rank
1, a
1.5x slow spell of rank 1 and a burst of corrupted batches (a loss spike).

Figures, all read back through the REST API:

* effective training time ratio: productive step time / wall time.  Productive step time is
  the sum of the step times (``step_s_max``, the slowest rank's wall time of the step) of the
  steps that made the final model: for each step index, the last attempt that trained it
  (steps redone after a restart or thrown away by a rollback do not count, start-up and
  recovery do not either).  Wall time: from starting the agent to its exit.
* per fault: seconds from the worker's ``fault_injected`` event to the incident (detection)
  and to the first step report of the attempt that recovered from it (first resumed step);
  steps lost: steps trained by the failed attempt beyond the step it resumed from.
* final evaluation loss (``final_eval_loss`` of the run summary) of both runs.

    .venv/bin/python benchmarks/goodput.py
    .venv/bin/python benchmarks/goodput.py --steps 3000 --json /tmp/goodput.json

``--scaled`` runs the simulated large-run benchmark of ``benchmarks/goodput_scaled.py``
instead (no processes started):

    .venv/bin/python benchmarks/goodput.py --scaled --json /tmp/goodput-scaled.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the test helpers live in the repository
    sys.path.insert(0, str(REPO))

import goodput_scaled  # noqa: E402  (benchmarks/ is the script's directory)
from detection import Agent, command_line, fmt  # noqa: E402

from tests.e2e.system import Supervisor, wait_until  # noqa: E402

FINAL = ("completed", "failed", "stopped")
# fault kind -> the incident the supervisor should open for it
EXPECTED = {"crash": "crash", "hang": "hang", "slow": "straggler", "spike": "loss_spike"}


def schedule(steps: int) -> list[str]:
    """Faults at fixed fractions of the run, each in the middle of a checkpoint interval."""
    at = [int(steps * f) // 100 * 100 + 50 for f in (0.175, 0.375, 0.55, 0.775)]
    return [f"crash@{at[0]}:rank=1", f"hang@{at[1]}:rank=1",
            f"slow@{at[2]}:rank=1:len=200", f"spike@{at[3]}"]


@dataclass
class Incident:
    fault: str
    fired_at: float
    incident: str | None = None
    incident_step: int | None = None
    detect_s: float | None = None
    resume_s: float | None = None  # fault -> first step report of the recovered attempt
    resumed_step: int | None = None
    steps_lost: int | None = None
    action: str = ""


@dataclass
class RunFigures:
    label: str
    run: str
    status: str | None = None
    attempts: int = 0
    wall_s: float = 0.0
    productive_s: float = 0.0
    ratio: float | None = None
    steps_trained: int = 0  # step reports of rank 0 over all attempts (redone ones included)
    final_eval_loss: float | None = None
    incidents: list[Incident] = field(default_factory=list)
    error: str = ""


def run_once(sup: Supervisor, label: str, root: Path, train: list[str], timeout: float
             ) -> RunFigures:
    name = f"goodput-{label}-{uuid.uuid4().hex[:6]}"
    work = root / name
    summary = work / "summary.json"
    train = [*train, "--checkpoint-dir", str(work / "ck"), "--summary-json", str(summary)]
    fig = RunFigures(label=label, run=name)
    t0 = time.monotonic()
    agent = Agent(sup.url, name, work, train)
    try:
        if agent.wait(timeout) is None:
            fig.error = f"agent still running after {timeout:.0f} s (stopped)"
    finally:
        agent.stop()
    fig.wall_s = time.monotonic() - t0
    run = wait_until(lambda: (r := sup.get_or_none(f"/runs/{name}")) is not None
                     and r["status"] in FINAL and r, 15, "the run to end")
    fig.status, fig.attempts = run["status"], int(run["attempt"]) + 1
    if summary.exists():
        fig.final_eval_loss = json.loads(summary.read_text()).get("final_eval_loss")
    body = sup.get(f"/runs/{name}/steps?max_points=100000")
    # points: the final lineage (one attempt's aggregate per step); superseded: the rest
    points = [*body["points"], *body["superseded"]]
    fig.steps_trained = len(points)
    fig.productive_s = sum(float(p["step_s_max"] or 0.0) for p in body["points"])
    fig.ratio = fig.productive_s / fig.wall_s if fig.wall_s > 0 else None
    fig.incidents = incidents_of(sup, name, points)
    return fig


def incidents_of(sup: Supervisor, name: str, points: list[dict[str, Any]]) -> list[Incident]:
    events = sup.get(f"/runs/{name}/events")["events"]
    incidents = sup.get(f"/runs/{name}/incidents")["incidents"]
    actions = sup.get(f"/runs/{name}/actions")["actions"]
    high = {}  # attempt -> highest step it reported
    for p in points:
        high[p["attempt"]] = max(high.get(p["attempt"], -1), int(p["step_to"]))
    out = []
    for ev in sorted((e for e in events if e["name"] == "fault_injected"), key=lambda e: e["t"]):
        d = ev.get("details") or {}
        kind = str(d.get("kind"))
        inc = Incident(fault=f"{kind}@{d.get('at')}", fired_at=float(ev["t"]))
        want = EXPECTED.get(kind)
        match = [i for i in incidents if i["kind"] == want and i["opened_at"] >= ev["t"] - 1.0]
        if match:
            i = min(match, key=lambda i: i["opened_at"])
            inc.incident, inc.incident_step = i["kind"], i["step"]
            inc.detect_s = i["opened_at"] - ev["t"]
            act = next((a for a in actions if a.get("incident_id") == i["id"]
                        and a["kind"] == "restart"), None)
            if act is not None:
                inc.action = act["reason"][:90]
                resumed = (act.get("progress") or {}).get("resumed")
                if resumed is not None:
                    inc.resume_s = resumed - ev["t"]
                    inc.resumed_step = act.get("resumed_step")
                failed = high.get(i["attempt"])
                if failed is not None and inc.resumed_step is not None:
                    inc.steps_lost = max(0, failed + 1 - inc.resumed_step)
            else:
                inc.action = "none (no restart)"
        out.append(inc)
    return out


def report(clean: RunFigures, faulty: RunFigures, *, command: str, steps: int,
           faults: list[str]) -> str:
    lines = [f"## Goodput ({steps} steps, faults {', '.join(faults)})", "",
             f"Command: `{command}`", "",
             "| run | status | attempts | wall s | productive step s | effective training "
             "time ratio | step reports (rank 0) | final eval loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for f in (clean, faulty):
        lines.append(f"| {f.label} | {f.status} | {f.attempts} | {f.wall_s:.1f} | "
                     f"{f.productive_s:.1f} | {fmt(None if f.ratio is None else 100 * f.ratio)}%"
                     f" | {f.steps_trained} | "
                     f"{'-' if f.final_eval_loss is None else f'{f.final_eval_loss:.4f}'} |")
    ratio = (faulty.ratio / clean.ratio) if faulty.ratio and clean.ratio else None
    loss = (faulty.final_eval_loss / clean.final_eval_loss - 1
            if faulty.final_eval_loss and clean.final_eval_loss else None)
    lines += ["",
              f"Faulty / clean, measured side by side: effective training time ratio "
              f"{fmt(ratio, 3)}x, wall time {faulty.wall_s / clean.wall_s:.2f}x, final eval "
              f"loss {'-' if loss is None else f'{loss:+.1%}'}.", "",
              "| fault | incident | at step | fault -> detected s | fault -> first resumed "
              "step s | resumed at | steps lost | action |",
              "|---|---|---:|---:|---:|---:|---:|---|"]
    for i in faulty.incidents:
        lines.append(f"| {i.fault} | {i.incident or 'none'} | {i.incident_step} | "
                     f"{fmt(i.detect_s)} | {fmt(i.resume_s)} | {i.resumed_step} | "
                     f"{i.steps_lost if i.steps_lost is not None else '-'} | {i.action} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--step-sleep", type=float, default=0.02, metavar="S",
                    help="extra compute per step, so a 1.5x slow rank is tens of ms behind")
    ap.add_argument("--checkpoint-every-steps", type=int, default=100)
    ap.add_argument("--run-timeout", type=float, default=600.0, metavar="S")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write both runs' figures here")
    ap.add_argument("--scaled", action="store_true",
                    help="instead: weeks of a large run under published failure rates, "
                         "simulated with the ETTR accumulator (benchmarks/goodput_scaled.py)")
    goodput_scaled.add_arguments(ap)
    args = ap.parse_args()
    if args.scaled:
        goodput_scaled.main(args, command_line())
        return
    if args.steps < 800:
        ap.error("--steps must be >= 800 (room for four faults and their recoveries)")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="trainwarden-goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    command = command_line()
    faults = schedule(args.steps)
    base = ["--steps", str(args.steps), "--hidden", "32", "--seed", "2",
            "--step-sleep", f"{args.step_sleep:g}",
            "--checkpoint-every-steps", str(args.checkpoint_every_steps)]
    print(f"# command: {command}\n# work dir {root}; {os.cpu_count()} CPUs; faults {faults}",
          flush=True)
    sup = Supervisor(root / "supervisor", None).start()
    try:
        clean = run_once(sup, "clean", root, base, args.run_timeout)
        print(f"clean: {clean.status}, {clean.wall_s:.0f} s", flush=True)
        inject = [x for f in faults for x in ("--inject", f)]
        faulty = run_once(sup, "faulty", root, [*base, *inject], args.run_timeout)
        print(f"faulty: {faulty.status}, {faulty.wall_s:.0f} s", flush=True)
    finally:
        sup.stop()
    if args.json:
        args.json.write_text(json.dumps({"command": command, "faults": faults,
                                         "clean": asdict(clean), "faulty": asdict(faulty)},
                                        indent=1))
    print()
    print(report(clean, faulty, command=command, steps=args.steps, faults=faults))


if __name__ == "__main__":
    main()

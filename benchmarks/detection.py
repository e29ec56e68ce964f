"""Detection and recovery latency: each fault of the catalogue, injected into a real run.

For every fault kind a real 2-worker ``torchrun`` DDP run (``examples/train_ddp.py``, gloo on
CPU) is started under one node agent, against one supervisor subprocess shared by the whole
benchmark (SQLite, default settings except ``TRAINWARDEN_HANG_FLOOR_S`` when ``--hang-floor``
is given).  Every run has a fresh name.  Per run the benchmark reads, through the REST API:

* detection: the ``fault_injected`` event's ``t`` (the worker's clock when the fault fired)
  to the first incident's ``opened_at`` (the supervisor's clock; same machine);
* the incident's kind, rank and step against the expected ones;
* for the kinds that restart the gang (crash, hang, collective timeout; spike and nan roll
  back to an earlier checkpoint, which is a restart too), the incident to the first step
  report of the new attempt (the restart action's ``progress.resumed``), the step it resumed
  at, and the run's final status;
* for clean runs (no fault), the number of incidents, which must be 0.

Faults (``--inject`` of the example): ``crash`` SIGKILLs rank 1 at a step; ``hang`` stops
rank 1 (the 60 s collective timeout is longer than the hang deadline); ``collective_timeout``
is the same hang with ``--timeout 2`` so rank 0's all-reduce times out first; ``slow`` makes
rank 1's compute 1.5x longer from a step on (``--step-sleep 0.02`` so compute is tens of ms);
``spike`` corrupts 20 batches' data; ``nan`` makes one batch non-finite.

    .venv/bin/python benchmarks/detection.py
    .venv/bin/python benchmarks/detection.py --kinds crash,slow --reps 1 --clean-reps 1
    .venv/bin/python benchmarks/detection.py --hang-floor 6 --json /tmp/detection.json

Runs are sequential (timing on a 2-core machine is the point); each is a few hundred steps.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the test helpers live in the repository
    sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from tests.e2e.system import (  # noqa: E402
    AGENT_TOKEN,
    Supervisor,
    ddp_script,
    wait_until,
)
from tests.e2e.torchrun import TORCHRUN, worker_env  # noqa: E402
from trainwarden.agent.core.hang import HangConfig  # noqa: E402

DEFAULT_HANG_FLOOR_S = HangConfig().floor_s  # the supervisor's default hang.floor_s
FINAL = ("completed", "failed", "stopped")
RESTART_KINDS = ("crash", "hang", "collective_timeout")
ALL_KINDS = ("crash", "hang", "collective_timeout", "slow", "spike", "nan")


@dataclass(frozen=True)
class Scenario:
    """One fault kind: the training flags and what the supervisor should say about it."""

    kind: str  # the benchmark's name for it
    at: int  # the step (or batch) the fault fires at
    train: tuple[str, ...]  # extra train_ddp.py flags, --inject included
    incident: str  # expected incident kind
    ranks: tuple[int | None, ...]  # acceptable incident ranks
    steps: tuple[int, int]  # acceptable incident steps, inclusive range
    target: str  # the detection target, in words
    restarts: bool  # the policy restarts the gang (spike and nan: a rollback)


def scenarios(hang_floor: float) -> dict[str, Scenario]:
    # The hang scenario's collective timeout stays well above the hang deadline.
    coll = max(60.0, 3 * hang_floor)
    return {
        "crash": Scenario(
            "crash", 100, ("--steps", "200", "--inject", "crash@100:rank=1"), "crash", (1,),
            (99, 100), "<= 5 s", True),
        # Both ranks' newest report is step 99 (rank 0 waits in step 100's all-reduce), so
        # the detector names no rank as "behind": None is the honest answer, the stacks
        # show the stuck one.
        "hang": Scenario(
            "hang", 100, ("--steps", "200", "--timeout", f"{coll:g}",
                          "--inject", "hang@100:rank=1"), "hang", (1, None),
            (99, 100), "<= max(30 s, 10 x median step) + stacks", True),
        # The rank that times out is the one that waited (0), not the one that hung.
        "collective_timeout": Scenario(
            "collective_timeout", 100, ("--steps", "200", "--timeout", "2",
                                        "--inject", "hang@100:rank=1"), "collective_timeout",
            (0,), (99, 100), "(none; the collective's own timeout, 2 s here)", True),
        "slow": Scenario(
            "slow", 60, ("--steps", "200", "--step-sleep", "0.02",
                         "--inject", "slow@60:rank=1"), "straggler", (1,), (60, 110),
            "right rank within 50 steps and 60 s", False),
        "spike": Scenario(
            "spike", 80, ("--steps", "200", "--inject", "spike@80"), "loss_spike",
            (None, 0, 1), (80, 80), "(none set)", True),
        "nan": Scenario(
            "nan", 100, ("--steps", "200", "--inject", "nan@100"), "nonfinite", (None, 0, 1),
            (100, 100), "(none set)", True),
    }


CLEAN_TRAIN = ("--steps", "200", "--step-sleep", "0.02")
BASE_TRAIN = ("--hidden", "32", "--seed", "2", "--checkpoint-every-steps", "50")


@dataclass
class RunResult:
    kind: str  # scenario kind or "clean"
    run: str
    status: str | None = None
    restarts: int | None = None
    agent_rc: int | None = None
    wall_s: float = 0.0
    injected_at: float | None = None
    incidents: list[dict[str, Any]] = field(default_factory=list)
    incident_kind: str | None = None
    incident_rank: int | None = None
    incident_step: int | None = None
    detect_s: float | None = None
    resume_s: float | None = None  # incident opened -> first step of the new attempt
    fault_to_resume_s: float | None = None
    resumed_step: int | None = None
    kind_ok: bool = False
    rank_ok: bool = False
    step_ok: bool = False
    stacks_ok: bool | None = None  # hang only: details.stacks holds the stuck rank
    median_step_s: float | None = None
    flagged_at_step: int | None = None
    within_target: bool | None = None
    error: str = ""


class Agent:
    """``trainwarden agent ... -- torchrun ...`` (as tests.e2e.system.Agent), taken down by its
    own SIGTERM handling, with a sweep of whatever carries the run's name if that fails."""

    def __init__(self, supervisor_url: str, run: str, workdir: Path, train: list[str]) -> None:
        self.run = run
        self.log = workdir / "agent.log"
        workdir.mkdir(parents=True, exist_ok=True)
        env = {**worker_env(), "TRAINWARDEN_AGENT_TOKEN": AGENT_TOKEN}
        cmd = [sys.executable, "-m", "trainwarden.agent.cli", "--supervisor", supervisor_url,
               "--run", run,
               "--node", "node0", "--state-dir", str(workdir / "state"), "--stop-grace", "2",
               "--", TORCHRUN, "--monitor-interval=0.1", "--nproc_per_node=2", "--standalone",
               *ddp_script(*train)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=workdir)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        # Workers the agent started carry TRAINWARDEN_RUN=<our fresh run name>.
        for p in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error):
                if p.environ().get("TRAINWARDEN_RUN") == self.run:
                    p.kill()


def first_incident(incidents: list[dict[str, Any]]) -> dict[str, Any] | None:
    return min(incidents, key=lambda i: (i["opened_at"], i["id"]), default=None)


def measure(sup: Supervisor, sc: Scenario | None, root: Path, timeout: float,
            hang_floor: float) -> RunResult:
    kind = sc.kind if sc else "clean"
    name = f"det-{kind}-{uuid.uuid4().hex[:6]}"
    work = root / name
    train = [*BASE_TRAIN, "--checkpoint-dir", str(work / "ck"),
             *(sc.train if sc else CLEAN_TRAIN)]
    res = RunResult(kind=kind, run=name)
    t0 = time.monotonic()
    agent = Agent(sup.url, name, work, train)
    try:
        res.agent_rc = agent.wait(timeout)
        if res.agent_rc is None:
            res.error = f"agent still running after {timeout:.0f} s (stopped)"
    finally:
        agent.stop()
    res.wall_s = time.monotonic() - t0
    try:
        run = wait_until(lambda: (r := sup.get_or_none(f"/runs/{name}")) is not None
                         and r["status"] in FINAL and r, 15, "the run to end")
    except AssertionError:
        run = sup.get_or_none(f"/runs/{name}") or {}
        res.error = (res.error + "; " if res.error else "") + "run not final 15 s after agent"
    res.status, res.restarts = run.get("status"), run.get("restarts")
    if not run:
        return res
    incidents = sup.get(f"/runs/{name}/incidents")["incidents"]
    events = sup.get(f"/runs/{name}/events")["events"]
    actions = sup.get(f"/runs/{name}/actions")["actions"]
    res.incidents = [{k: i.get(k) for k in ("id", "kind", "rank", "step", "attempt",
                                            "opened_at", "cause")} for i in incidents]
    if sc is None:
        return res
    fired = [e["t"] for e in events if e["name"] == "fault_injected"]
    res.injected_at = min(fired) if fired else None
    inc = first_incident(incidents)
    if inc is None:
        res.error = (res.error + "; " if res.error else "") + "no incident"
        return res
    res.incident_kind, res.incident_rank, res.incident_step = inc["kind"], inc["rank"], inc["step"]
    res.kind_ok = inc["kind"] == sc.incident
    res.rank_ok = inc["rank"] in sc.ranks
    res.step_ok = inc["step"] is not None and sc.steps[0] <= inc["step"] <= sc.steps[1]
    if res.injected_at is not None:
        res.detect_s = inc["opened_at"] - res.injected_at
    details = inc.get("details") or {}
    if sc.kind == "hang":
        stacks = details.get("stacks") or {}
        res.stacks_ok = bool(stacks.get("1"))
        res.median_step_s = details.get("median_step_s")
    if sc.kind == "slow":
        res.flagged_at_step = details.get("flagged_at_step")
    # Any restart the incident caused, expected or not.
    act = next((a for a in actions if a.get("incident_id") == inc["id"]
                and a["kind"] == "restart"), None)
    resumed = ((act or {}).get("progress") or {}).get("resumed")
    if act is not None and resumed is not None:
        res.resume_s = resumed - inc["opened_at"]
        res.resumed_step = act.get("resumed_step")
        if res.injected_at is not None:
            res.fault_to_resume_s = resumed - res.injected_at
    if sc.restarts and res.resume_s is None:
        res.error = (res.error + "; " if res.error else "") + "no restart resumed"
    if not sc.restarts and res.restarts:
        res.error = (res.error + "; " if res.error else "") + f"{res.restarts} restart(s)"
    res.within_target = target_met(res, sc, hang_floor)
    return res


def target_met(r: RunResult, sc: Scenario, hang_floor: float) -> bool | None:
    if r.detect_s is None or not r.kind_ok:
        return False
    if sc.kind == "crash":
        return r.detect_s <= 5.0
    if sc.kind == "hang":
        limit = max(30.0, 10 * (r.median_step_s or 0.0))
        return r.detect_s <= limit and bool(r.stacks_ok)
    if sc.kind == "slow":
        flagged = r.flagged_at_step if r.flagged_at_step is not None else r.incident_step
        return (r.rank_ok and flagged is not None and flagged - sc.at <= 50
                and r.detect_s <= 60.0)
    return None


def command_line() -> str:
    """How this benchmark was started, to print beside its figures."""
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(Path.cwd())
    return shlex.join([str(exe), *sys.argv])


def fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summary_table(results: list[RunResult], scs: dict[str, Scenario]) -> str:
    head = ("| fault | expected incident | n | detection median s | detection max s | "
            "target | within target | incident -> first resumed step median s "
            "(max) | fault -> resumed median s | kind ok | rank ok | step ok | "
            "incidents per run | final status |")
    lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
    order = [k for k in ALL_KINDS if k in scs] + ["clean"]
    for kind in order:
        rs = [r for r in results if r.kind == kind]
        if not rs:
            continue
        statuses = ", ".join(f"{s} x{c}" for s, c in Counter(str(r.status) for r in rs).items())
        n = len(rs)
        counts = [len(r.incidents) for r in rs]
        if kind == "clean":
            kinds = Counter(i["kind"] for r in rs for i in r.incidents)
            extra = f" {dict(kinds)}" if kinds else ""
            lines.append(
                f"| clean (no fault) | none | {n} | - | - | 0 incidents | "
                f"{sum(c == 0 for c in counts)}/{n} | - | - | - | - | - | {counts}{extra} | "
                f"{statuses} |")
            continue
        sc = scs[kind]
        det = [r.detect_s for r in rs if r.detect_s is not None]
        res = [r.resume_s for r in rs if r.resume_s is not None]
        f2r = [r.fault_to_resume_s for r in rs if r.fault_to_resume_s is not None]
        within = [r.within_target for r in rs]
        within_s = "-" if all(w is None for w in within) else f"{sum(bool(w) for w in within)}/{n}"
        if kind == "hang":
            within_s += f" (stacks {sum(bool(r.stacks_ok) for r in rs)}/{n})"
        resume = "-" if not res else f"{fmt(med(res))} ({fmt(max(res))})"
        seen = Counter(str(r.incident_kind) for r in rs)
        kind_ok = f"{sum(r.kind_ok for r in rs)}/{n}"
        if seen.keys() - {sc.incident}:
            kind_ok += " (saw " + ", ".join(f"{k} x{c}" for k, c in seen.items()) + ")"
        lines.append(
            f"| {kind} | {sc.incident} | {n} | {fmt(med(det))} | "
            f"{fmt(max(det) if det else None)} | {sc.target} | {within_s} | {resume} | "
            f"{fmt(med(f2r))} | {kind_ok} | "
            f"{sum(r.rank_ok for r in rs)}/{n} | {sum(r.step_ok for r in rs)}/{n} | "
            f"{counts} | {statuses} |")
    return "\n".join(lines)


def runs_table(results: list[RunResult]) -> str:
    lines = ["| run | incident kind | rank | step | detection s | incident -> resumed s | "
             "resumed step | restarts | status | incidents | wall s | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        note = r.error
        if r.stacks_ok is not None:
            note = (note + "; " if note else "") + f"stacks of rank 1: {r.stacks_ok}"
        if r.median_step_s is not None:
            note = (note + "; " if note else "") + f"median step {r.median_step_s * 1000:.1f} ms"
        if r.flagged_at_step is not None:
            note = (note + "; " if note else "") + f"flagged at step {r.flagged_at_step}"
        lines.append(
            f"| {r.run} | {r.incident_kind or '-'} | {r.incident_rank} | {r.incident_step} | "
            f"{fmt(r.detect_s, 2)} | {fmt(r.resume_s, 2)} | {r.resumed_step} | {r.restarts} | "
            f"{r.status} | {', '.join(str(i['kind']) for i in r.incidents) or '0'} | "
            f"{r.wall_s:.0f} | {note} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(ALL_KINDS),
                    help=f"comma-separated subset of {','.join(ALL_KINDS)} (default: all)")
    ap.add_argument("--reps", type=int, default=3, help="runs per fault kind")
    ap.add_argument("--clean-reps", type=int, default=3, help="runs without a fault")
    ap.add_argument("--hang-floor", type=float, default=None, metavar="S",
                    help=f"TRAINWARDEN_HANG_FLOOR_S for the supervisor (default: its own "
                         f"default, {DEFAULT_HANG_FLOOR_S:g} s)")
    ap.add_argument("--run-timeout", type=float, default=240.0, metavar="S",
                    help="give up on one run after this long")
    ap.add_argument("--workdir", type=Path, default=None,
                    help="keep logs, checkpoints and the supervisor's database here")
    ap.add_argument("--json", type=Path, default=None, help="write every run's figures here")
    ap.add_argument("--report", type=Path, default=None, metavar="JSON",
                    help="only print the tables of an earlier --json file")
    args = ap.parse_args()
    if args.report:
        report_from_json(args.report)
        return
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(ALL_KINDS))
    if unknown:
        ap.error(f"unknown --kinds {unknown}; choose from {','.join(ALL_KINDS)}")
    floor = args.hang_floor if args.hang_floor is not None else DEFAULT_HANG_FLOOR_S
    scs = {k: v for k, v in scenarios(floor).items() if k in kinds}
    root = args.workdir or Path(tempfile.mkdtemp(prefix="trainwarden-detection-"))
    root.mkdir(parents=True, exist_ok=True)
    env = {} if args.hang_floor is None else {"TRAINWARDEN_HANG_FLOOR_S": f"{args.hang_floor:g}"}
    command = command_line()
    print(f"# command: {command}", flush=True)
    print(f"# hang floor: {floor:g} s ({'--hang-floor' if env else 'supervisor default'}); "
          f"work dir {root}; {os.cpu_count()} CPUs", flush=True)

    sup = Supervisor(root / "supervisor", None, env=env).start()
    results: list[RunResult] = []
    t_start = time.monotonic()
    try:
        plan: list[Scenario | None] = [sc for sc in scs.values() for _ in range(args.reps)]
        plan += [None] * args.clean_reps
        for i, sc in enumerate(plan, 1):
            r = measure(sup, sc, root, args.run_timeout, floor)
            results.append(r)
            print(f"[{i}/{len(plan)}] {r.run}: incident {r.incident_kind or '-'} rank "
                  f"{r.incident_rank} step {r.incident_step}, detection {fmt(r.detect_s, 2)} s, "
                  f"resume {fmt(r.resume_s, 2)} s, status {r.status}, "
                  f"incidents {len(r.incidents)}, {r.wall_s:.0f} s"
                  f"{', ' + r.error if r.error else ''}", flush=True)
    finally:
        sup.stop()
    total = time.monotonic() - t_start
    if args.json:
        args.json.write_text(json.dumps({"command": command, "hang_floor_s": floor,
                                         "minutes": total / 60, "kinds": list(scs),
                                         "results": [asdict(r) for r in results]}, indent=1))
    report(results, scs, command=command, floor=floor, minutes=total / 60)


def report(results: list[RunResult], scs: dict[str, Scenario], *, command: str, floor: float,
           minutes: float) -> None:
    print()
    print(f"## Detection benchmark ({minutes:.1f} min, hang floor {floor:g} s)")
    print()
    print(f"Command: `{command}`")
    print()
    print(summary_table(results, scs))
    print()
    print("Targets: crash within 5 s; hang within max(30 s, 10 x median step time) "
          "with the stuck rank's stack captured; a 1.5x straggler named (right rank) within "
          "50 steps / 60 s; 0 incidents on clean runs.  Detection is from the worker's "
          "`fault_injected` event to the first incident's `opened_at`; resume is from "
          "`opened_at` to the restart action's `progress.resumed` (first step report of the "
          "new attempt, as the supervisor's evaluator saw it).  Hang rank: None is accepted "
          "(both ranks stop at the same step, so none is behind; the stacks name the stuck "
          "one).  Straggler target: `details.flagged_at_step` <= fault step + 50 and "
          "detection <= 60 s.")
    print()
    print(runs_table(results))


def report_from_json(path: Path) -> None:
    """Print the tables again from a ``--json`` file (no runs)."""
    data = json.loads(path.read_text())
    results = [RunResult(**r) for r in data["results"]]
    kinds = data.get("kinds") or {r.kind for r in results}
    scs = {k: v for k, v in scenarios(data["hang_floor_s"]).items() if k in kinds}
    report(results, scs, command=data["command"], floor=data["hang_floor_s"],
           minutes=data.get("minutes", sum(r.wall_s for r in results) / 60))


if __name__ == "__main__":
    main()

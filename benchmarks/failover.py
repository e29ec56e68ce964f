"""Failover: two supervisor replicas on one Postgres, the leader SIGKILLed mid-run, then faults.

A real 2-worker ``torchrun`` DDP run (``examples/train_ddp.py``, gloo on CPU) under one node
agent that knows both replicas' addresses (``--supervisor A,B``).  Replica A starts first and
takes the evaluator lease; once training is under way A is SIGKILLed.  Then the run meets a
SIGKILL of rank 1 (``crash``) and a burst of corrupted batches (``spike``), each once.  The
same training without faults and without a supervisor runs first, for reference.

Printed (and written as JSON with ``--json``):

* takeover: seconds from the SIGKILL of A to B reporting itself leader on
  ``GET /api/v1/evaluator`` (polled every 0.1 s), with the lease epoch B leads under, and
  the agent's own failover (from its log: the first "failing over" line after the kill);
* per fault: its incidents and its actions (each should be exactly one);
* step records: per attempt, the steps stored; the steps of the final lineage (each step's
  last attempt) stored with other than both ranks (lost or doubled: should be none), and
  whether that lineage covers every step; for information, the partial last steps of the
  attempts the supervisor ended (their ranks are killed a moment apart);
* the run's end status, and whether the final weights equal the clean run's.  A crash-only
  schedule resumes bit-identically; a spike is rolled back with the corrupted batches
  skipped, so its weights differ from a clean run's by design (then "n/a").

    .venv/bin/python benchmarks/failover.py \\
        --postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/test
    .venv/bin/python benchmarks/failover.py --faults crash --json /tmp/failover.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the test helpers live in the repository
    sys.path.insert(0, str(REPO))

from detection import Agent, command_line  # noqa: E402  (benchmarks/ is the script's directory)

from tests.e2e.system import Supervisor, postgres_schema, wait_until  # noqa: E402
from tests.e2e.torchrun import run_example  # noqa: E402

ENV_POSTGRES = "TRAINWARDEN_TEST_POSTGRES_URL"
FINAL = ("completed", "failed", "stopped")
EXPECTED = {"crash": "crash", "spike": "loss_spike"}


def faults_for(kinds: list[str], steps: int, every: int) -> list[str]:
    """Each fault in the middle of a checkpoint interval, after the kill (at 15%)."""
    out = []
    for n, kind in enumerate(kinds):
        at = int(steps * (0.45 + 0.3 * n)) // every * every + every // 2
        out.append(f"crash@{at}:rank=1" if kind == "crash" else f"{kind}@{at}")
    return out


def failover_of(log: Path, after: float) -> float | None:
    """Seconds from ``after`` (unix) to the agent's first "failing over" line."""
    from datetime import datetime

    for line in log.read_text(errors="replace").splitlines():
        if "failing over" not in line:
            continue
        try:
            t = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        except ValueError:
            continue
        if t >= after - 1.0:
            return round(max(0.0, t - after), 2)
    return None


def step_records(lineage: list[dict[str, Any]], superseded: list[dict[str, Any]], steps: int,
                 world: int) -> dict[str, Any]:
    """``lineage`` and ``superseded``: the steps API's ``points`` (the final lineage, one
    attempt's record per step) and ``superseded`` (the other attempts' records)."""
    by_attempt: dict[int, list[dict[str, Any]]] = {}
    for p in [*lineage, *superseded]:
        by_attempt.setdefault(int(p["attempt"]), []).append(p)
    final = {int(p["step_from"]): p for p in lineage}  # step -> its record on the lineage
    return {
        "per_attempt": {a: len(ps) for a, ps in sorted(by_attempt.items())},
        # Lost or doubled records of the steps that made the final model: should be none.
        "lineage_not_all_ranks": [s for s, p in sorted(final.items()) if p["ranks"] != world],
        "lineage_complete": sorted(final) == list(range(steps)),
        # The last steps of an attempt the supervisor ended (its ranks killed a moment
        # apart), for information.
        "ended_partial": [(int(p["attempt"]), int(p["step_from"]), int(p["ranks"]))
                          for p in superseded if p["ranks"] != world],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--postgres-url", default=os.environ.get(ENV_POSTGRES),
                    help=f"the Postgres the replicas share (default ${ENV_POSTGRES}); a "
                         "schema of its own is made and dropped")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--step-sleep", type=float, default=0.02, metavar="S")
    ap.add_argument("--checkpoint-every-steps", type=int, default=100)
    ap.add_argument("--faults", default="crash,spike",
                    help="comma-separated, in order after the kill: crash, spike")
    ap.add_argument("--run-timeout", type=float, default=600.0, metavar="S")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if not args.postgres_url:
        ap.error(f"--postgres-url (or ${ENV_POSTGRES}) is needed: the replicas share it")
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    if any(k not in EXPECTED for k in kinds):
        ap.error(f"--faults: use {', '.join(EXPECTED)}")
    root = args.workdir or Path(tempfile.mkdtemp(prefix="tw-failover-"))
    root.mkdir(parents=True, exist_ok=True)
    every = args.checkpoint_every_steps
    train = ["--steps", str(args.steps), "--hidden", "32", "--seed", "5",
             "--checkpoint-every-steps", str(every), "--step-sleep", str(args.step_sleep)]
    faults = faults_for(kinds, args.steps, every)
    t_clean = time.monotonic()
    clean_dir = root / "clean"
    clean_dir.mkdir()
    clean = run_example("train_ddp.py", clean_dir, *train, "--checkpoint-dir",
                        str(clean_dir / "ck"), timeout=args.run_timeout)
    if clean.returncode != 0 or clean.summary is None:
        raise SystemExit(f"the clean run failed:\n{clean.output[-3000:]}")
    clean_s = time.monotonic() - t_clean

    out: dict[str, Any] = {"command": command_line(), "steps": args.steps, "faults": faults,
                           "clean_wall_s": round(clean_s, 1)}
    with postgres_schema(args.postgres_url) as url:
        a, b = (Supervisor(root / n, None, "--db", url) for n in ("a", "b"))
        try:
            a.start()
            b.start()
            wait_until(lambda: (a.get_or_none("/evaluator") or {}).get("leader"), 30,
                       "replica a to lead")
            work = root / "run"
            summary = work / "summary.json"
            t0 = time.monotonic()
            agent = Agent(f"{a.url},{b.url}", "failover", work, [
                *train, "--checkpoint-dir", str(work / "ck"), "--summary-json", str(summary),
                *(x for f in faults for x in ("--inject", f))])
            try:
                wait_until(lambda: ((b.get_or_none("/runs/failover") or {}).get("step") or 0)
                           >= args.steps * 15 // 100, 300, "training to be under way")
                killed_at, killed = time.time(), time.monotonic()
                a.kill()
                led = wait_until(lambda: (r := b.get_or_none("/evaluator")) and r["leader"]
                                 and r, 60, "replica b to lead", interval=0.1)
                out["takeover_s"] = round(time.monotonic() - killed, 2)
                out["epoch"] = led["epoch"]
                code = agent.wait(args.run_timeout)
            finally:
                agent.stop()
            out["agent_exit"] = code
            out["wall_s"] = round(time.monotonic() - t0, 1)
            out["agent_failover_s"] = failover_of(agent.log, killed_at)
            run = wait_until(lambda: (r := b.get_or_none("/runs/failover")) is not None
                             and r["status"] in FINAL and r, 30, "the run to end")
            out["status"], out["restarts"] = run["status"], run["restarts"]
            incidents = b.get("/runs/failover/incidents")["incidents"]
            actions = b.get("/runs/failover/actions")["actions"]
            out["faults_handled"] = {
                kind: {"incidents": sum(1 for i in incidents if i["kind"] == EXPECTED[kind]),
                       "actions": sum(1 for x in actions if any(
                           i["id"] == x["incident_id"] and i["kind"] == EXPECTED[kind]
                           for i in incidents))}
                for kind in kinds}
            out["other_incidents"] = [i["kind"] for i in incidents
                                      if i["kind"] not in {EXPECTED[k] for k in kinds}]
            out["actions"] = len(actions)
            body = b.get("/runs/failover/steps?max_points=100000")
            out["step_records"] = step_records(body["points"], body["superseded"], args.steps, 2)
            weights = json.loads(summary.read_text()).get("weights_sha256") \
                if summary.exists() else None
            out["weights_equal_clean"] = (weights == clean.summary.get("weights_sha256")) \
                if "spike" not in kinds else "n/a (the rollback skips the corrupted batches)"
            out["refused_decisions"] = b.tail(10**7).count("decision refused by the store")
        finally:
            for s in (a, b):
                s.stop()
    print(report(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


def report(out: dict[str, Any]) -> str:
    lines = [f"## Failover ({out['steps']} steps, faults after the kill: "
             f"{', '.join(out['faults'])})", "", f"Command: `{out['command']}`", "",
             f"- takeover after SIGKILL of the leader: {out['takeover_s']} s (standby leads "
             f"under lease epoch {out['epoch']}); the agent failed over to the standby "
             f"{out['agent_failover_s']} s after the kill",
             f"- run: {out['status']}, {out['restarts']} restart(s), agent exit "
             f"{out['agent_exit']}, wall {out['wall_s']} s (clean run {out['clean_wall_s']} s)"]
    for kind, n in out["faults_handled"].items():
        lines.append(f"- {kind}: {n['incidents']} incident(s), {n['actions']} action(s)")
    rec = out["step_records"]
    lines += [f"- other incidents: {out['other_incidents'] or 'none'}; actions in all: "
              f"{out['actions']}; decisions refused by the fence: {out['refused_decisions']}",
              f"- step records per attempt: {rec['per_attempt']}; steps of the final "
              f"lineage stored with other than both ranks (lost or doubled): "
              f"{rec['lineage_not_all_ranks'] or 'none'}; the final lineage covers every "
              f"step: {rec['lineage_complete']}; partial last steps of ended attempts "
              f"(attempt, step, ranks): {rec['ended_partial'] or 'none'}",
              f"- final weights equal the clean run's: {out['weights_equal_clean']}"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""A node that dies: from its death to the first resumed step, with a spare and without one.

Three node agents on this machine (``trainwarden agent``, each a node with its own state dir)
around the two-node command a user writes (``torchrun --nnodes=2 --nproc_per_node=1
--rdzv-backend=c10d``, ``examples/train_ddp.py``, gloo on CPU), one supervisor on SQLite with
the defaults a user gets (node-lost deadline 30 s).  Once training passes ``--kill-at``, the
whole process tree of the node holding node rank 1 (agent, torchrun, worker) is SIGKILLed.

* ``spare``: a third agent started with ``--spare``.  Measured: seconds from the kill to the
  replacement restart being decided, and to the first resumed step (the action's ``resumed``
  progress mark), with the restart anatomy's phases of that restart (stop, launch,
  rendezvous, checkpoint load, first step), and whether the run ends with the clean run's
  weights.
* ``shrink``: no spare, both members started with ``--min-nodes 1``: the run goes on with the
  surviving node (the same global batch, two micro-batches per step on its one rank).
  Measured as ``spare``: to the decision, to the first step on the smaller world, that
  restart's phases, and whether the run ends with the clean two-node run's weights.
* ``crash``: the baseline a node's death is compared with: two members and a spare as in
  ``spare``, but only the worker process of node rank 1 is SIGKILLed (its node lives on).
  Measured as ``spare``: to the crash restart's decision and its first resumed step.
* ``none``: no spare (what a run without spares gets, and what every run got before spares:
  its gang restart waits for the node that is gone).  Measured: whether a step resumes within
  ``--wait`` seconds after the kill, the run's status and reason at the end of the wait, and
  the restart actions decided meanwhile (no loop: they stay at two).
* ``clean``: two members, no fault, nothing killed: the run to its end.  Measured: the
  node-lost incidents (there must be none), every incident by kind, the restarts, the
  status, whether the run ends with the clean run's weights.
* ``saturated``: ``clean`` on a CPU-saturated machine: ``--burners`` busy-loop processes
  (default 2, one per core of the 2-core test machine) run from before the agents start to
  the run's end.  Measured as ``clean``, with the load average at the end.

    .venv/bin/python benchmarks/nodes.py --json /tmp/nodes.json
    .venv/bin/python benchmarks/nodes.py --modes spare,crash --repeat 3
    .venv/bin/python benchmarks/nodes.py --modes shrink --repeat 3
    .venv/bin/python benchmarks/nodes.py --modes clean,saturated --repeat 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the test helpers live in the repository
    sys.path.insert(0, str(REPO))

from tests.e2e.system import (  # noqa: E402
    Agent,
    Supervisor,
    ddp_script,
    free_rendezvous_port,
    wait_until,
)
from tests.e2e.torchrun import run_example  # noqa: E402

FINAL = ("completed", "failed", "stopped")


def _command(work: Path, run: str, port: int, steps: int, train: list[str]) -> list[str]:
    return ["--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={run}",
            *ddp_script("--steps", str(steps), *train, "--checkpoint-dir", str(work / "ck"),
                        "--summary-json", str(work / "summary.json"))]


def one(mode: str, tmp: Path, args: argparse.Namespace, train: list[str],
        clean_sha: str | None) -> dict[str, Any]:
    sup = Supervisor(tmp / "supervisor").start()
    run, work, port = f"nodes-{mode}", tmp / "run", free_rendezvous_port()
    agents: dict[str, Agent] = {}
    out: dict[str, Any] = {"mode": mode}
    burners: list[subprocess.Popen[bytes]] = []
    if mode == "saturated":
        burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                   for _ in range(args.burners)]
        out["burners"] = args.burners
    try:
        for node in ("node0", "node1"):
            agents[node] = Agent(sup.url, run, node, work / node,
                                 _command(work, run, port, args.steps, train),
                                 agent_args=("--min-nodes", "1") if mode == "shrink" else ())
        if mode in ("spare", "crash"):
            agents["spare0"] = Agent(sup.url, run, "spare0", work / "spare0",
                                     _command(work, run, port, args.steps, train),
                                     agent_args=("--spare",))

        def step() -> int:
            return int((sup.get_or_none(f"/runs/{run}") or {}).get("step") or 0)

        if mode in ("clean", "saturated"):
            started = time.time()
            end = wait_until(lambda: (r := sup.get_or_none(f"/runs/{run}")) is not None
                             and r["status"] in FINAL and r, 900, "the run to end",
                             interval=1.0)
            out["run_s"] = round(time.time() - started, 1)
            out["load_avg_1m"] = round(os.getloadavg()[0], 2)
            out["status"] = end["status"]
            out["restarts"] = {k: v for k, v in end["restarts_by_cause"].items() if v}
            incidents = sup.get(f"/runs/{run}/incidents")["incidents"]
            out["node_lost_incidents"] = sum(i["kind"] == "node_lost" for i in incidents)
            out["incidents"] = [(i["kind"], i["node"]) for i in incidents]
            summary = json.loads((work / "summary.json").read_text())
            out["weights_equal_clean"] = summary["weights_sha256"] == clean_sha
            return out

        wait_until(lambda: step() >= args.kill_at, 300, f"step {args.kill_at}")
        (victim,) = [a["node"] for a in sup.get(f"/runs/{run}")["agents"]
                     if a["node_rank"] == 1]
        killed_at = time.time()
        if mode == "crash":  # the newest process of the node's tree: its worker
            worker = max(agents[victim].tree()[1:], key=lambda p: p.create_time())
            worker.send_signal(signal.SIGKILL)
        else:
            agents[victim].signal_tree(signal.SIGKILL)
        out["victim"] = victim
        cause = "crash" if mode == "crash" else "node_lost"
        if mode in ("spare", "shrink", "crash"):
            def replaced() -> dict[str, Any] | None:
                acts = sup.get(f"/runs/{run}/actions")["actions"]
                done = [a for a in acts if a["cause"] == cause
                        and a["status"] == "resumed"]
                return done[0] if done else None

            act = wait_until(replaced, 300, "the replacement to resume")
            progress = act["progress"]
            out["decided_s"] = round(progress["queued"] - killed_at, 2)
            out["resumed_s"] = round(progress["resumed"] - killed_at, 2)
            out["phases_s"] = sup.get(f"/actions/{act['id']}")["anatomy"]["phases_s"]
            end = wait_until(lambda: (r := sup.get(f"/runs/{run}"))["status"] in FINAL and r,
                             600, "the run to end")
            out["status"] = end["status"]
            out["restarts"] = {k: v for k, v in end["restarts_by_cause"].items() if v}
            out["incidents"] = [(i["kind"], i["node"]) for i in
                                sup.get(f"/runs/{run}/incidents")["incidents"]]
            summary = json.loads((work / "summary.json").read_text())
            out["weights_equal_clean"] = summary["weights_sha256"] == clean_sha
        else:
            resumed = None
            while time.time() < killed_at + args.wait:  # polled once a second
                acts = sup.get(f"/runs/{run}/actions")["actions"]
                done = [a for a in acts if a["status"] == "resumed"]
                if done:
                    resumed = done[0]["progress"]["resumed"] - killed_at
                    break
                time.sleep(1.0)
            r = sup.get(f"/runs/{run}")
            out["resumed_within_wait"] = resumed is not None
            out["wait_s"] = args.wait
            out["status"], out["reason"] = r["status"], r["reason"]
            out["missing"] = r["membership"]["missing"]
            out["restart_actions"] = len(sup.get(f"/runs/{run}/actions")["actions"])
    finally:
        for a in agents.values():
            a.signal_tree(signal.SIGCONT)
            a.stop()
        sup.stop()
        for b in burners:
            b.kill()
            b.wait()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="spare,shrink,none",
                   help="spare, crash, shrink, none, clean, saturated (comma-separated)")
    p.add_argument("--burners", type=int, default=2,
                   help="saturated: busy-loop processes running beside the run")
    p.add_argument("--repeat", type=int, default=1, help="runs per mode")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--kill-at", type=int, default=120)
    p.add_argument("--wait", type=float, default=150.0,
                   help="none: seconds after the kill to watch for a resumed step")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    train = ["--hidden", "32", "--seed", "11", "--checkpoint-every-steps", "50",
             "--step-sleep", "0.02"]
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="tw-nodes-") as d:
        clean_dir = Path(d) / "clean"
        clean_dir.mkdir()
        clean = run_example("train_ddp.py", clean_dir, "--steps", str(args.steps), *train,
                            "--checkpoint-dir", str(clean_dir / "ck"))
        clean_sha = clean.summary["weights_sha256"] if clean.summary else None
        for mode in args.modes.split(","):
            for i in range(args.repeat):
                tmp = Path(d) / f"{mode}-{i}"
                tmp.mkdir()
                r = one(mode, tmp, args, train, clean_sha)
                print(json.dumps(r), flush=True)
                results.append(r)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`make demo`: the embedded default, end to end, on this machine.

Starts the supervisor on a SQLite file in ./demo-data, then one node agent wrapping a real
2-worker `torchrun` of examples/train_ddp.py with faults injected (rank 1 is killed with
SIGKILL mid-run, and later 20 batches of corrupted data make the loss spike).  Watch the
supervisor notice, restart the whole run from the newest complete checkpoint, roll back past
the spike (skipping its batches, LR lowered for a while), and finish.  The supervisor stays
up afterwards so you can look around; Ctrl-C stops everything.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=str(REPO / "demo-data"))
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--inject", action="append", default=None,
                    help="faults for the training script "
                         "(default: crash@1200:rank=1 and spike@2000)")
    ap.add_argument("--exit-when-done", action="store_true",
                    help="stop the supervisor once the run has ended (for scripted use)")
    args = ap.parse_args()
    inject = args.inject or ["crash@1200:rank=1", "spike@2000"]

    data = Path(args.data_dir)
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    agent_token, operator_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    env = {**os.environ, "TRAINWARDEN_AGENT_TOKEN": agent_token,
           "TRAINWARDEN_OPERATOR_TOKEN": operator_token, "OMP_NUM_THREADS": "1"}
    port_file = data / "port"
    procs: list[subprocess.Popen[bytes]] = []

    def stop_all(*_: Any) -> None:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(130))
    try:
        sup_log = open(data / "supervisor.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "trainwarden.supervisor.cli", "supervisor",
             "--data-dir", str(data),
             "--port", str(args.port), "--public-reads", "--port-file", str(port_file),
             "--log-level", "warning"],
            env=env, stdout=sup_log, stderr=subprocess.STDOUT, cwd=REPO))
        url = wait_for_supervisor(port_file, procs[0])
        print(f"supervisor: {url}  (SQLite: {data / 'trainwarden.db'}, log: {sup_log.name})")

        ckpt = data / "checkpoints"
        train = [TORCHRUN, "--nproc_per_node=2", "--standalone", "--monitor-interval=0.1",
                 str(REPO / "examples" / "train_ddp.py"), "--steps", str(args.steps),
                 "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                 "--step-sleep", "0.004", "--summary-json", str(data / "summary.json"),
                 # a nominal peak for one CPU core, so the dashboard can show MFU
                 "--peak-tflops", "0.05"]
        for spec in inject:
            train += ["--inject", spec]
        agent_log = open(data / "agent.log", "wb")  # noqa: SIM115
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "trainwarden.agent.cli", "--supervisor", url, "--run", "demo",
             "--node", "node0", "--state-dir", str(data / "agent"), "--checkpoint-root",
             str(ckpt), "--", *train],
            env=env, stdout=agent_log, stderr=subprocess.STDOUT, cwd=REPO))
        print(f"agent: node0 running `torchrun --nproc_per_node=2 examples/train_ddp.py "
              f"--inject {' --inject '.join(inject)}` (log: {agent_log.name})")
        print()
        print("Look at (reads are public in the demo; writes need the operator token):")
        print(f"  {url}/runs/demo   (the dashboard: charts, incidents, actions, roll back)")
        for path in ("/metrics", "/docs", "/api/v1/runs", "/api/v1/runs/demo",
                     "/api/v1/runs/demo/incidents", "/api/v1/runs/demo/actions",
                     "/api/v1/runs/demo/checkpoints", "/api/v1/runs/demo/steps?max_points=20"):
            print(f"  {url}{path}")
        print(f"  operator token: {operator_token}")
        print()
        outcome = follow(url, procs[1])
        if args.exit_when_done:
            return 0 if outcome == "completed" else 1
        print("\nThe supervisor stays up: Ctrl-C to stop.")
        while procs[0].poll() is None:
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        print("\nstopping")
        return 0
    finally:
        stop_all()


def wait_for_supervisor(port_file: Path, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the supervisor exited with {proc.returncode}; see its log")
        if port_file.exists() and port_file.read_text().strip():
            url = f"http://127.0.0.1:{port_file.read_text().strip()}"
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.2)
    raise SystemExit("the supervisor did not come up within 60 s")


def follow(url: str, agent: subprocess.Popen[bytes]) -> str:
    """Print what the supervisor sees until the run ends; returns the run's final status."""
    seen_incidents: set[Any] = set()
    seen_actions: dict[Any, str] = {}
    last_line = ""
    next_at = 0.0
    agent_gone_at: float | None = None
    with httpx.Client(base_url=f"{url}/api/v1", timeout=5) as client:
        while True:
            try:
                run = client.get("/runs/demo")
                if run.status_code == 404:
                    time.sleep(0.5)
                    continue
                r = run.json()
                for inc in client.get("/runs/demo/incidents").json()["incidents"]:
                    key = (inc["id"], inc["status"])
                    if key not in seen_incidents:
                        seen_incidents.add(key)
                        print(f"  ! incident #{inc['id']} {inc['kind']} ({inc['status']}): "
                              f"{inc['cause']}")
                for act in client.get("/runs/demo/actions").json()["actions"]:
                    state = f"{act['kind']} {act['status']}"
                    if act["status"] == "resumed":
                        state += f" at step {act.get('resumed_step')}"
                    if seen_actions.get(act["id"]) != state:
                        seen_actions[act["id"]] = state
                        print(f"  > action #{act['id']} {state}: {act.get('reason', '')}")
            except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError):
                time.sleep(0.5)
                continue
            step = "-" if r.get("step") is None else r["step"]
            line = (f"  run demo: {r.get('status')}, attempt {r.get('attempt')}, "
                    f"step {step}, restarts {r.get('restarts')}")
            if line.split(", step")[0] != last_line.split(", step")[0] or time.time() > next_at:
                next_at = time.time() + 5
                print(line)
                last_line = line
            if r.get("status") in ("completed", "failed", "stopped"):
                return str(r.get("status"))
            if agent.poll() is not None:
                # The agent's last batch (its exit) may still be on its way to the run's
                # status: give the supervisor a few seconds before calling the run unfinished.
                if agent_gone_at is None:
                    agent_gone_at = time.monotonic()
                    print(f"  agent exited with {agent.returncode}")
                elif time.monotonic() - agent_gone_at > 15:
                    return str(r.get("status"))
            time.sleep(1.0)


if __name__ == "__main__":
    raise SystemExit(main())

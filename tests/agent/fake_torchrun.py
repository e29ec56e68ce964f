"""A stand-in for torchrun, run by the agent's launcher in tests.

It spawns ``--nproc`` "workers" the way torchrun does (each in its own session, with RANK and
LOCAL_RANK set), and each worker reports steps over the agent socket with
``trainwarden.agent.protocol.encode_datagram``.  Every process writes
``<pid-dir>/<role>-<pid>.json``
with its environment marks, so tests can check which processes exist and what they were told.

Modes (``--mode``):
  serve     workers step until killed; torchrun waits on them (exit 0 when all ended)
  complete  workers send ``--steps`` steps and exit 0; torchrun exits 0
  exit      no workers: send one event, exit with ``--code`` (negative: kill self by signal)
  crash     workers step; after ``--steps`` steps rank 1 is SIGKILLed and torchrun prints
            torch's failure summary and exits 1 (as torchrun does)
  hang      workers send ``--steps`` steps, then block in ``stuck_in_collective`` forever;
            like the real in-training library they dump their stacks on SIGUSR1
Unknown options (torchrun's ``--nnodes``, ``--node-rank``...) are accepted and recorded.
Options: ``--ignore-term`` makes workers (and a grandchild each) ignore SIGTERM;
``--grandchild`` gives each worker a child that sleeps forever.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainwarden.agent import protocol


def _record(pid_dir: Path, role: str) -> None:
    keys = [protocol.ENV_ATTEMPT, protocol.ENV_RESUME_PLAN, protocol.ENV_RUN, protocol.ENV_NODE,
            protocol.ENV_AGENT_SOCKET, protocol.ENV_PREFLIGHT, protocol.ENV_PREFLIGHT_TIMEOUT,
            "TRAINWARDEN_PREFLIGHT_INJECT", "RANK", "LOCAL_RANK"]
    data: dict[str, Any] = {k: os.environ.get(k) for k in keys}
    data["pid"] = os.getpid()
    data["role"] = role
    data["argv"] = sys.argv[1:]
    plan = os.environ.get(protocol.ENV_RESUME_PLAN)
    if plan:
        data["plan"] = json.loads(Path(plan).read_text())
    tmp = pid_dir / f".{role}-{os.getpid()}.tmp"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, pid_dir / f"{role}-{os.getpid()}.json")


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # the agent is away: drop, like the real library
        sock.sendto(protocol.encode_datagram(msg),  # type: ignore[arg-type]
                    os.environ[protocol.ENV_AGENT_SOCKET])


def worker(args: argparse.Namespace) -> int:
    pid_dir = Path(args.pid_dir)
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        subprocess.Popen([sys.executable, __file__, "--role", "grandchild",
                          "--pid-dir", args.pid_dir] + (["--ignore-term"] if args.ignore_term
                                                        else []))
    _record(pid_dir, "worker")
    rank = int(os.environ["RANK"])
    attempt = int(os.environ.get(protocol.ENV_ATTEMPT, "0"))
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    _send(sock, {"type": "event", "v": 1, "attempt": attempt, "rank": rank,
                 "local_rank": rank, "pid": os.getpid(), "t": time.time(),
                 "name": protocol.WorkerEventName.STARTED, "message": "", "details": {}})
    if args.mode == "hang":
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    step = 0
    while args.mode not in ("complete", "hang") or step < args.steps:
        _send(sock, {"type": "step", "v": 1, "attempt": attempt, "rank": rank,
                     "local_rank": rank, "world_size": args.nproc, "pid": os.getpid(),
                     "step": step, "t": time.time(), "loss": 1.0 / (step + 1), "dropped": 0})
        step += 1
        time.sleep(args.step_s)
    if args.mode == "hang":
        stuck_in_collective()
    return 0


def stuck_in_collective() -> None:
    while True:  # alive, no progress: what a stuck all-reduce looks like from outside
        time.sleep(3600)


def grandchild(args: argparse.Namespace) -> int:
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _record(Path(args.pid_dir), "grandchild")
    while True:
        time.sleep(1)


_SUMMARY = """[W] torch.distributed.elastic.multiprocessing.api: Sending process {other} closing
Traceback (most recent call last):
  File "/usr/bin/torchrun", line 8, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : node
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: {pid})
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID {pid}
============================================================
"""


def torchrun(args: argparse.Namespace) -> int:
    pid_dir = Path(args.pid_dir)
    _record(pid_dir, "torchrun")
    print(f"fake torchrun mode={args.mode} attempt={os.environ.get(protocol.ENV_ATTEMPT)}",
          flush=True)
    if args.mode == "exit":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        _send(sock, {"type": "event", "v": 1, "attempt": 0, "rank": 0, "local_rank": 0,
                     "pid": os.getpid(), "t": time.time(), "name": "about_to_exit",
                     "message": "", "details": {}})
        if args.code < 0:
            os.kill(os.getpid(), -args.code)
            time.sleep(10)
        return args.code
    procs = []
    for r in range(args.nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r))
        cmd = [sys.executable, __file__, "--role", "worker", "--mode", args.mode,
               "--pid-dir", args.pid_dir, "--nproc", str(args.nproc), "--steps",
               str(args.steps), "--step-s", str(args.step_s)]
        cmd += ["--ignore-term"] if args.ignore_term else []
        cmd += ["--grandchild"] if args.grandchild else []
        # Like torch's SubprocessHandler: each worker in its own session.
        procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
    if args.mode == "crash":
        # Let the workers start and report a few steps, then lose rank 1 as an OOM kill would.
        deadline = time.monotonic() + 10
        while len(list(pid_dir.glob("worker-*.json"))) < args.nproc:
            if time.monotonic() > deadline:
                return 2
            time.sleep(0.01)
        time.sleep(args.steps * args.step_s)
        victim = procs[1]
        victim.kill()
        victim.wait()
        for p in procs:
            p.kill()
            p.wait()
        sys.stderr.write(_SUMMARY.format(pid=victim.pid, other=procs[0].pid))
        sys.stderr.flush()
        return 1
    codes = [p.wait() for p in procs]
    return 0 if all(c == 0 for c in codes) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", default="torchrun")
    ap.add_argument("--mode", default="serve")
    ap.add_argument("--pid-dir", required=True)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument("--code", type=int, default=0)
    ap.add_argument("--ignore-term", action="store_true")
    ap.add_argument("--grandchild", action="store_true")
    # torchrun's own rendezvous options (what the agent writes for a membership) are taken
    # and recorded (``argv``), not acted on
    args, _ = ap.parse_known_args()
    return {"torchrun": torchrun, "worker": worker, "grandchild": grandchild}[args.role](args)


if __name__ == "__main__":
    sys.exit(main())

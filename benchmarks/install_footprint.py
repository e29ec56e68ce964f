"""What each role's install costs: time and disk per extra, and the import time of the
in-training library.

Builds the wheel, then for each extra creates a fresh virtual environment and installs
``trainwarden[EXTRA]`` from the wheel (pip's cache as it is on this machine: say whether it was
warm), and measures the environment's size beyond an empty venv.  The import time of
``trainwarden.agent.worker`` (what every training process pays) is the median over runs of a fresh
interpreter importing it, minus the same interpreter importing ``torch`` alone, since a
training script imports torch anyway.

    .venv/bin/python benchmarks/install_footprint.py [--extras supervisor,agent,cli] [--runs 7]
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

REPO = Path(__file__).resolve().parents[1]


def _du(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = Path(root) / f
            if not p.is_symlink():
                total += p.stat().st_size
    return total


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "VIRTUAL_ENV", "TRAINWARDEN_"))}


def _check(cmd: list[str], cwd: Path) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stdout}\n{r.stderr}")
    return r.stdout


def _import_seconds(python: Path, stmt: str, runs: int, cwd: Path) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        _check([str(python), "-c", stmt], cwd)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extras", default="supervisor,agent,cli")
    ap.add_argument("--runs", type=int, default=7)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tw-install-") as tmp:
        work = Path(tmp)
        # From the committed tree (git archive): a build in the working tree would reuse its
        # build/ folder, where deleted files linger.
        src = work / "src"
        src.mkdir()
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        _check([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(work),
                str(src)], work)
        (whl,) = work.glob("trainwarden-*.whl")
        empty = work / "empty"
        _check([sys.executable, "-m", "venv", str(empty)], work)
        base = _du(empty)
        rows = []
        agent_python = None
        for extra in args.extras.split(","):
            venv = work / f"venv-{extra}"
            _check([sys.executable, "-m", "venv", str(venv)], work)
            t = time.perf_counter()
            _check([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c",
                    str(REPO / "constraints.txt"), f"trainwarden[{extra}] @ {whl.as_uri()}"],
                   work)
            seconds = time.perf_counter() - t
            rows.append((extra, seconds, _du(venv) - base))
            if extra == "agent":
                agent_python = venv / "bin" / "python"
        kb = whl.stat().st_size / 1e3
        print(f"wheel {whl.name}, {kb:.0f} kB; Python {sys.version.split()[0]}")
        print("install from the wheel into a fresh venv (pip cache as found on this machine)\n")
        print("| extra | install s | size beyond an empty venv |")
        print("|---|---:|---:|")
        for extra, seconds, size in rows:
            print(f"| `trainwarden[{extra}]` | {seconds:.0f} | {size / 1e6:.0f} MB |")
        if agent_python is not None:
            torch_s = _import_seconds(agent_python, "import torch", args.runs, work)
            both_s = _import_seconds(agent_python, "import torch, trainwarden.agent.worker",
                                     args.runs, work)
            bare_s = _import_seconds(agent_python, "pass", args.runs, work)
            print("\nimport trainwarden.agent.worker after torch: "
                  f"{1e3 * (both_s - torch_s):.0f} ms "
                  f"(median of {args.runs}; import torch alone {1e3 * (torch_s - bare_s):.0f} ms, "
                  f"interpreter start {1e3 * bare_s:.0f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

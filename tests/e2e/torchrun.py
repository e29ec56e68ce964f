"""Run the example scripts under a real torchrun (gloo on CPU) and read what they leave."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# The Hugging Face examples build their models from configs: nothing may be fetched.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@dataclass
class RunResult:
    returncode: int
    output: str
    summary: dict[str, Any] | None
    batch_log: dict[int, list[tuple[str, int, int, float]]]


def torchrun_cmd(script: str, *args: str, nproc: int = 2, max_restarts: int = 0) -> list[str]:
    return [TORCHRUN, f"--nproc_per_node={nproc}", "--standalone",
            f"--max-restarts={max_restarts}", "--monitor-interval=0.1",
            str(EXAMPLES / script), *args]


def worker_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


def run_example(script: str, workdir: Path, *args: str, nproc: int = 2, max_restarts: int = 0,
                env: dict[str, str] | None = None, timeout: float = 240) -> RunResult:
    """Run ``script`` to the end; the summary and batch logs are read from ``workdir``."""
    summary = workdir / "summary.json"
    logs = workdir / "batches"
    cmd = torchrun_cmd(script, "--summary-json", str(summary), "--batch-log", str(logs), *args,
                       nproc=nproc, max_restarts=max_restarts)
    proc = subprocess.run(cmd, cwd=workdir, env=env or worker_env(), capture_output=True,
                          text=True, timeout=timeout)
    return RunResult(proc.returncode, proc.stdout + proc.stderr,
                     json.loads(summary.read_text()) if summary.exists() else None,
                     read_batch_logs(logs))


def read_batch_logs(directory: Path) -> dict[int, list[tuple[str, int, int, float]]]:
    out: dict[int, list[tuple[str, int, int, float]]] = {}
    if not directory.is_dir():
        return out
    for f in sorted(directory.glob("rank*.log")):
        rows = []
        for line in f.read_text().splitlines():
            attempt, step, index, lr = line.split()
            rows.append((attempt, int(step), int(index), float(lr)))
        out[int(f.stem.removeprefix("rank"))] = rows
    return out


def effective_history(rows: list[tuple[str, int, int, float]]) -> dict[int, int]:
    """step -> batch index as the final weights saw it: a later start of the script that
    trains a step again replaces the earlier one (steps redone after a rollback)."""
    hist: dict[int, int] = {}
    for _attempt, step, index, _lr in rows:
        hist[step] = index
    return hist


def trained(lineage: list[RunResult]) -> list[tuple[int, int]]:
    """(step, global batch) as the lineage trained them, launch after launch; every rank of a
    launch trains the same global batch at each step."""
    rows: list[tuple[int, int]] = []
    for r in lineage:
        per_rank = {rank: [(s, g) for _a, s, g, _lr in log] for rank, log in r.batch_log.items()}
        assert all(v == per_rank[0] for v in per_rank.values()), per_rank
        rows += per_rank[0]
    return rows

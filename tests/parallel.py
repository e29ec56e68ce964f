"""`make test`: the whole suite as two pytest processes side by side, one per shard.

    python -m tests.parallel              # both shards at once (tests/conftest.py: SHARDS)
    python -m tests.parallel -k resume    # any pytest arguments: one plain pytest run

Each shard writes to its own log and its own base temp directory (pytest prunes old numbered
temp directories, which would reach into the other process's); a line every 30 s says how far
each is; at the end both logs are printed whole, a failing one last, and the exit status is
the first non-zero one.  Ctrl-C (or SIGTERM) stops both.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.conftest import SHARD_ENV, SHARDS

REPO = Path(__file__).resolve().parents[1]
PROGRESS_EVERY_S = 30.0


def _progress(log: Path) -> str:
    """The newest line of a log (pytest -q prints a line of dots per 72 tests)."""
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return lines[-1][-80:] if lines else "(starting)"


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", "-q", "-rs"]  # -rs: why each skip skipped
    if argv:
        return subprocess.call([*pytest, *argv], cwd=REPO)
    work = Path(tempfile.mkdtemp(prefix="trainwarden-tests-"))
    procs: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    for shard in SHARDS:
        log = work / f"{shard}.log"
        env = {**os.environ, SHARD_ENV: shard}
        with log.open("wb") as out:
            procs[shard] = (subprocess.Popen(
                [*pytest, "--durations=15", "--basetemp", str(work / f"tmp-{shard}")],
                cwd=REPO, env=env,
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True), log)
    print(f"tests: shards {', '.join(SHARDS)} side by side; logs in {work}", flush=True)

    def stop(signum: int, frame: object) -> None:
        for proc, _ in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    t0 = time.monotonic()
    next_report = t0 + PROGRESS_EVERY_S
    while any(p.poll() is None for p, _ in procs.values()):
        time.sleep(0.5)
        if time.monotonic() >= next_report:
            next_report += PROGRESS_EVERY_S
            state = "; ".join(
                f"{s}: {'done' if p.poll() is not None else _progress(log)}"
                for s, (p, log) in procs.items())
            print(f"[{time.monotonic() - t0:5.0f} s] {state}", flush=True)
    codes = {s: p.returncode for s, (p, _) in procs.items()}
    for shard in sorted(SHARDS, key=lambda s: codes[s] != 0):  # a failing log last
        print(f"\n===== shard {shard}: exit {codes[shard]} =====", flush=True)
        sys.stdout.write(procs[shard][1].read_text(errors="replace"))
    print(f"\ntests: {', '.join(f'{s} exit {c}' for s, c in codes.items())} "
          f"in {time.monotonic() - t0:.0f} s", flush=True)
    return next((c for c in codes.values() if c != 0), 0)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

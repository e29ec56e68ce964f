"""init_distributed: the process group's threads are gone before the interpreter shuts down."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]

# Runs a training script as its own __main__ (one process, no torchrun: a one-rank gloo
# group).  The atexit hook registered first runs last, after trainwarden's: it counts the
# threads that the interpreter's own shutdown would meet.
WRAPPER = textwrap.dedent("""
    import atexit, os, runpy, sys

    def threads():
        return len(os.listdir("/proc/self/task"))

    print(f"before: {threads()}", flush=True)
    atexit.register(lambda: print(f"at shutdown: {threads()}", flush=True))
    script = sys.argv[1]
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")
""")


def test_backend_threads_are_joined_before_interpreter_shutdown(tmp_path: Path) -> None:
    # examples/train_ddp.py saves DCP checkpoints, whose state-dict helpers leave a reference
    # cycle that held the DDP model and its gloo group (3 threads) past destroy_process_group;
    # torn down during interpreter shutdown, a worker sometimes aborted after finishing.
    wrapper = tmp_path / "wrapper.py"
    wrapper.write_text(WRAPPER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRAINWARDEN_", "WORLD_SIZE", "RANK", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, str(wrapper), str(REPO / "examples" / "train_ddp.py"), "--steps", "20",
         "--checkpoint-every-steps", "10", "--hidden", "32", "--keep", "2",
         "--checkpoint-dir", str(tmp_path / "ck")],
        env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    counts = dict(re.findall(r"^(before|at shutdown): (\d+)$", proc.stdout, re.M))
    assert set(counts) == {"before", "at shutdown"}, proc.stdout
    assert (tmp_path / "ck" / "step_20").is_dir(), proc.stderr
    assert counts["at shutdown"] == counts["before"], proc.stdout

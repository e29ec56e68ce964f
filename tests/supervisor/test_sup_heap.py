"""The supervisor's processes settle their heap once started
(``trainwarden.supervisor.heap``): what
startup left alive is frozen out of the collector's walks, and a young collection waits for
``YOUNG_OBJECTS`` net new objects (at 2,048 agents the default schedule stopped the event
loop for 100-165 ms every 2-3 s)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.dashboard.browser import supervisor_process
from tests.waiting import wait_for
from trainwarden.supervisor import heap

REPO = Path(__file__).resolve().parents[3]


def test_settle_freezes_the_startup_heap_and_widens_the_young_generation() -> None:
    # In a process of its own: the test process's collector is left as it is.
    code = ("import gc, json; from trainwarden.supervisor import heap; "
            "import trainwarden.supervisor.server.app; "
            "before = gc.get_threshold(); n = heap.settle(); "
            "print(json.dumps([n, gc.get_freeze_count(), gc.get_threshold(), before]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    frozen, freeze_count, (young, middle, old), before = json.loads(out)
    assert frozen > 10_000  # the app's modules and objects
    assert freeze_count == frozen
    assert young == heap.YOUNG_OBJECTS
    assert (middle, old) == tuple(before[1:])  # the older generations' ratios are kept


def test_the_supervisor_a_user_starts_settles_its_heap(tmp_path: Path) -> None:
    with supervisor_process(tmp_path, agent_token="a", operator_token="o",
                            extra_args=["--log-level", "info"]):
        log = tmp_path / "supervisor.log"

        def settled() -> str | None:
            lines = [ln for ln in log.read_text().splitlines() if "heap settled" in ln]
            return lines[0] if lines else None

        line = wait_for(settled, 30, "the heap-settled log line")
    frozen = int(line.split("heap settled: ")[1].split()[0])
    assert frozen > 10_000

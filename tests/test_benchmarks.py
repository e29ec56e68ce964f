"""Every benchmark the README names still starts: its imports resolve against today's code and
its command line parses (the benchmarks themselves take minutes and run by hand)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
# The scripts (a module the scripts import, such as goodput_scaled.py, has no main of its own).
SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py")
                 if 'if __name__ == "__main__":' in p.read_text())


def test_the_benchmarks_are_found() -> None:
    assert "ingest.py" in SCRIPTS and "goodput.py" in SCRIPTS, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_starts(script: str) -> None:
    proc = subprocess.run([sys.executable, str(BENCHMARKS / script), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout, proc.stdout[-2000:]


def test_storage_benchmark_smoke() -> None:
    """The storage benchmark end to end on a tiny slice (a real supervisor for the RSS)."""
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "storage.py"), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GB/day with" in proc.stdout, proc.stdout[-2000:]
    assert "supervisor RSS after 2,000 steps" in proc.stdout, proc.stdout[-2000:]


def test_ingest_load_generator_sends_what_step_items_describe() -> None:
    """The load generator's pre-formatted bodies are the batches ``step_items`` and
    ``heartbeat`` describe (same keys and fixed values, random ones in range), and the
    supervisor's schema accepts them."""
    import json

    sys.path.insert(0, str(BENCHMARKS))
    try:
        import ingest as bench
    finally:
        sys.path.remove(str(BENCHMARKS))
    from supervisor import wire

    body = bench.encode_batch(7, 3, 1000.5, 999.25, range(4, 6), node=2, world=64)
    got = json.loads(body)
    want_items = [*bench.step_items(4, 999.25, node=2, world=64),
                  *bench.step_items(5, 999.25, node=2, world=64), bench.heartbeat(999.25, 2)]
    assert {k: got[k] for k in ("agent_id", "seq", "sent_at", "attempt", "dropped")} == {
        "agent_id": 7, "seq": 3, "sent_at": 1000.5, "attempt": 0, "dropped": 0}
    assert len(got["items"]) == len(want_items) == 17
    random_keys = {"loss", "grad_norm", "data_s", "compute_s", "step_s", "cpu_percent"}
    for g, w in zip(got["items"], want_items, strict=True):
        assert g.keys() == w.keys()
        assert {k: v for k, v in g.items() if k not in random_keys | {"workers"}} == {
            k: v for k, v in w.items() if k not in random_keys | {"workers"}}
    steps = got["items"][:-1]
    assert all(0.002 <= s["data_s"] <= 0.005 and 0.95 <= s["step_s"] <= 0.98 for s in steps)
    assert all(2.4 < s["loss"] < 2.6 for s in steps)
    assert [w["rank"] for w in got["items"][-1]["workers"]] == list(range(16, 24))
    assert len({s["loss"] for s in steps}) > 1  # the values vary
    wire.IngestBatch.model_validate_json(body)

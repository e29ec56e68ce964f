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

"""The disk detector: one finding when a node goes low, one when it recovers, no flapping."""

from __future__ import annotations

import pytest

from trainwarden.supervisor.detect.disk import DiskConfig, detect_disk
from trainwarden.supervisor.detect.findings import FindingKind

GiB = 2**30


def test_a_node_going_low_is_found_once_and_recovers_past_the_hysteresis() -> None:
    cfg = DiskConfig(low_ratio=0.10, hysteresis=0.02)
    usage = {"n0": (50 * GiB, 100 * GiB), "n1": (9 * GiB, 100 * GiB)}
    (f,) = detect_disk(usage, set(), cfg)
    assert f.kind == FindingKind.DISK_LOW and f.node == "n1" and f.severity == "event"
    assert f.details["free_ratio"] == 0.09 and "9.0% free" in f.message
    assert detect_disk(usage, {"n1"}, cfg) == []  # the same episode: nothing new
    # Back to 11%: within the hysteresis, still the same episode; 12%: recovered.
    assert detect_disk({"n1": (11 * GiB, 100 * GiB)}, {"n1"}, cfg) == []
    (r,) = detect_disk({"n1": (12 * GiB, 100 * GiB)}, {"n1"}, cfg)
    assert r.kind == FindingKind.DISK_RECOVERED and r.node == "n1"


def test_unknown_totals_are_passed_over_and_bad_configs_refused() -> None:
    assert detect_disk({"n0": (0, 0)}, set()) == []
    with pytest.raises(ValueError, match=r"disk\.low_ratio must be in \(0, 1\) \(got 1\.5\)"):
        DiskConfig(low_ratio=1.5)
    with pytest.raises(ValueError, match=r"disk\.hysteresis must be < 1 - low_ratio = 0\.5 \(got"
                       r" 0\.6\)"):
        DiskConfig(low_ratio=0.5, hysteresis=0.6)

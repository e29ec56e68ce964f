"""Disk filling: the free share of a node's checkpoint file system.

Agents report free and total bytes of the file system that holds the run's checkpoints with
every heartbeat.  A node goes low when the free share falls below ``low_ratio``, and counts as
recovered only once it is back above ``low_ratio + hysteresis`` (a save fills the disk for a
moment and retention frees it again: a share hovering at the threshold must not flap).
``low`` is the set of nodes already in a low episode (the caller keeps it), so one episode
gives one ``disk_low`` finding and one ``disk_recovered``.
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from dataclasses import dataclass
from typing import ClassVar

from trainwarden.agent.core.bounds import bounded, check, cross_check
from trainwarden.supervisor.detect.findings import EVENT, Finding, FindingKind

__all__ = ["DiskConfig", "detect_disk"]


@dataclass(frozen=True)
class DiskConfig:
    SECTION: ClassVar[str] = "disk"

    # free share of the checkpoint disk below which it is low
    low_ratio: float = bounded(0.10, gt=0, lt=1, hint="try 0.1")
    hysteresis: float = bounded(0.02, ge=0)  # recovered only above low_ratio + this

    def __post_init__(self) -> None:
        check(self)
        cross_check(self.hysteresis < 1 - self.low_ratio, self, "hysteresis",
                    f"< 1 - low_ratio = {1 - self.low_ratio:g}", got=self.hysteresis,
                    hint="lower hysteresis or low_ratio")


def detect_disk(usage: Mapping[str, tuple[int, int]], low: Set[str],
                cfg: DiskConfig | None = None) -> list[Finding]:
    """``usage``: node -> (free bytes, total bytes).  Findings sorted by node: ``disk_low``
    for a node newly below the threshold, ``disk_recovered`` for one of ``low`` back above it
    (plus the hysteresis).  Nodes with no total (not reported) are passed over."""
    cfg = cfg or DiskConfig()
    out = []
    for node, (free, total) in sorted(usage.items()):
        if total <= 0:
            continue
        ratio = free / total
        details = {"free_bytes": free, "total_bytes": total, "free_ratio": round(ratio, 4),
                   "low_ratio": cfg.low_ratio, "node": node}
        if node not in low and ratio < cfg.low_ratio:
            out.append(Finding(
                kind=FindingKind.DISK_LOW, severity=EVENT, node=node, details=details,
                message=f"checkpoint disk on node {node} almost full: {ratio:.1%} free "
                        f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB; threshold "
                        f"{cfg.low_ratio:.0%})"))
        elif node in low and ratio >= cfg.low_ratio + cfg.hysteresis - 1e-9:
            out.append(Finding(
                kind=FindingKind.DISK_RECOVERED, severity=EVENT, node=node, details=details,
                message=f"checkpoint disk on node {node} has room again: {ratio:.1%} free"))
    return out

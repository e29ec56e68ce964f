"""The detectors' vocabulary: ``Finding`` (defined in the shared core, ``agent.core.findings``,
because the agent's hang watchdog returns one too), its severities, and the kind names the
detectors of this package use."""

from __future__ import annotations

from agent.core.findings import EVENT, INCIDENT, STEP_KEYED, Finding, FindingKind, Severity

__all__ = ["DISK_LOW", "DISK_RECOVERED", "EVENT", "HANG", "INCIDENT", "LOSS_SPIKE",
           "LOSS_SPIKE_TRANSIENT", "NODE_LOST", "NONFINITE", "RANK_STALLED", "STEP_KEYED",
           "STRAGGLER", "THROUGHPUT_DECAY", "Finding", "FindingKind", "Severity"]

HANG = FindingKind.HANG
RANK_STALLED = FindingKind.RANK_STALLED
STRAGGLER = FindingKind.STRAGGLER
LOSS_SPIKE = FindingKind.LOSS_SPIKE
LOSS_SPIKE_TRANSIENT = FindingKind.LOSS_SPIKE_TRANSIENT
NONFINITE = FindingKind.NONFINITE
THROUGHPUT_DECAY = FindingKind.THROUGHPUT_DECAY
NODE_LOST = FindingKind.NODE_LOST
DISK_LOW = FindingKind.DISK_LOW
DISK_RECOVERED = FindingKind.DISK_RECOVERED

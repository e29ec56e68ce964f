"""What every detector returns: a ``Finding``, and the vocabulary of finding kinds.

A finding is an observation, not a decision: the policy (the one place that decides) turns
findings into incidents and actions.  ``severity`` says how the detector rates it:
``"incident"`` (training is broken or wasting the cluster: act) or ``"event"`` (worth
recording and alerting on, not worth a restart by itself).

An evaluator that calls a detector on every tick gets the same finding again while the
condition lasts; ``Finding.key`` is what to deduplicate on: ``(kind, step, rank, node)`` for
kinds whose start step is exact and stable (hang, loss spikes, non-finite values), and
``(kind, None, rank, node)`` for kinds whose ``step`` is an estimate that can move as the
window slides (straggler onset, throughput decay onset, rank_stalled, node_lost).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Severity(StrEnum):
    INCIDENT = "incident"
    EVENT = "event"


INCIDENT = Severity.INCIDENT
EVENT = Severity.EVENT


class FindingKind(StrEnum):
    """The kinds the detectors produce (the values are stored and exported as they are)."""

    HANG = "hang"
    RANK_STALLED = "rank_stalled"
    STRAGGLER = "straggler"
    LOSS_SPIKE = "loss_spike"
    LOSS_SPIKE_TRANSIENT = "loss_spike_transient"
    NONFINITE = "nonfinite"
    THROUGHPUT_DECAY = "throughput_decay"
    NODE_LOST = "node_lost"
    DISK_LOW = "disk_low"
    DISK_RECOVERED = "disk_recovered"


# Kinds whose ``step`` is exact and stable across ticks (part of the deduplication key).
STEP_KEYED = frozenset({FindingKind.HANG, FindingKind.LOSS_SPIKE,
                        FindingKind.LOSS_SPIKE_TRANSIENT, FindingKind.NONFINITE})


@dataclass(frozen=True)
class Finding:
    """One thing a detector saw.

    ``step``: the step where the condition started (the first high loss step, the first slow
    step of a straggler, the last step made before a hang), or ``None`` where steps do not
    apply.  ``started_at``: unix time it started, where known.  ``message`` is for people and
    names what and where, with the numbers; ``details`` holds the same numbers for machines
    (plain JSON-able values)."""

    kind: str
    severity: Severity
    message: str
    step: int | None = None
    rank: int | None = None
    node: str | None = None
    started_at: float | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, int | None, int | None, str | None]:
        """What identifies the same condition across ticks (for deduplication)."""
        step = self.step if self.kind in STEP_KEYED else None
        return (self.kind, step, self.rank, self.node)

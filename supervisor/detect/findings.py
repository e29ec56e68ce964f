"""The detectors' vocabulary: ``Finding`` (defined in the shared core,
``trainwarden.agent.core.findings``,
because the agent's hang watchdog returns one too), its severities, and the kinds
(``FindingKind``, named by their members: one vocabulary)."""

from __future__ import annotations

from trainwarden.agent.core.findings import (
    EVENT,
    INCIDENT,
    STEP_KEYED,
    Finding,
    FindingKind,
    Severity,
)

__all__ = ["EVENT", "INCIDENT", "STEP_KEYED", "Finding", "FindingKind", "Severity"]

"""Checkpoint protection: what the workers' retention must keep."""

from __future__ import annotations

from dataclasses import dataclass

from trainwarden.supervisor.control.policy.core import ROLLBACK_KINDS, PolicyConfig

PROTECT_MAX = 16  # paths per run; the oldest incidents' checkpoints go first past it


@dataclass(frozen=True)
class ProtectFacts:
    # Complete checkpoints of the current lineage: (step, unix time saved, path), oldest first.
    checkpoints: tuple[tuple[int, float, str], ...] = ()
    # Open incidents: (kind, step where it started or None, opened at).
    open_incidents: tuple[tuple[str, int | None, float], ...] = ()
    # Checkpoints named by restart actions not yet resumed (a rollback's target).
    pending_targets: tuple[str, ...] = ()


def protected_checkpoints(facts: ProtectFacts, cfg: PolicyConfig) -> list[str]:
    """The checkpoints retention must keep besides the newest few: for each open incident the
    last good checkpoint before it (for a spike, the one a rollback would pick: ``margin``
    steps before its start; without a step, the newest saved before it opened), and the
    target of every pending restart.  Sorted, at most ``PROTECT_MAX``."""
    out: list[str] = list(dict.fromkeys(facts.pending_targets))
    for kind, step, opened_at in sorted(facts.open_incidents, key=lambda i: -i[2]):
        if step is not None:
            limit = step - (cfg.rollback_margin_steps if kind in ROLLBACK_KINDS else 0)
            good = [p for s, _, p in facts.checkpoints if s <= limit]
        else:
            good = [p for _, t, p in facts.checkpoints if t <= opened_at]
        if good and good[-1] not in out:
            out.append(good[-1])
    return sorted(out[:PROTECT_MAX])

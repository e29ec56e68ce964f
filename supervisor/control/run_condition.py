"""A run's condition at a glance (pure): WAITING (a node rank has no node fit to run and no
spare to take it) or SHRUNK (running on fewer nodes than it declares), with what ends it.  The
runs list, the run page's headline, ``GET /api/v1/runs`` and ``/metrics`` show this one
computation.

A run that runs on its full world and waits for nothing has no condition (None): its status
says it all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from trainwarden.supervisor.enums import ACTIVE_STATUSES


class Condition(StrEnum):
    WAITING = "waiting"
    SHRUNK = "shrunk"


@dataclass(frozen=True)
class RunCondition:
    state: Condition
    summary: str  # one line: what it is, and how it ends
    since: float | None  # when it began (None: not known)

    def as_dict(self) -> dict[str, object]:
        return {"state": str(self.state), "summary": self.summary, "since": self.since}


SPARE_HINT = "start `trainwarden agent --spare` with the run's command on a standby node"


def run_condition(*, status: str, waiting: Mapping[int, str], spares_configured: bool,
                  world: int | None, declared: int | None, waiting_since: float | None = None,
                  shrunk_since: float | None = None, requeued: str = "") -> RunCondition | None:
    """``waiting``: node rank -> why it has no node (``node1 lost``), of the current attempt;
    ``world``/``declared``: the nodes the current attempt runs on and the run's declared
    world; the times: when the wait and the shrink began; ``requeued``: what the run's
    scheduler job became for this wait (``fleet.requeue``: "job 7 was requeued without
    node1"), "" when it was not requeued."""
    if status not in ACTIVE_STATUSES:
        return None
    if waiting:
        ranks = sorted(waiting)
        what = "; ".join(f"node rank {k}: {waiting[k]}" for k in ranks[:8])
        more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
        spares = ("no spare left" if spares_configured else "no spare configured")
        if requeued:
            return RunCondition(
                Condition.WAITING,
                f"WAITING for a node ({what}{more}); {spares}: {requeued}, and the run goes "
                "on when its new allocation registers", waiting_since)
        return RunCondition(
            Condition.WAITING,
            f"WAITING for a node ({what}{more}); {spares}: {SPARE_HINT}, or bring the lost "
            "node back", waiting_since)
    if world is not None and declared is not None and world < declared:
        return RunCondition(
            Condition.SHRUNK,
            f"SHRUNK to {world} of {declared} declared nodes; it grows back at its next "
            f"checkpoint once a node is free ({SPARE_HINT}, or bring a lost node back)",
            shrunk_since)
    return None

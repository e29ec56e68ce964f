"""Agent timestamps against the supervisor's clock: the allowed skew (``IngestConfig``),
the check of one batch (``ClockCheck``) and the ``clock_skew`` event that counts what was
replaced (one an hour per agent)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from sqlalchemy import (
    Connection,
    select,
    update,
)

from trainwarden.agent.core.bounds import bounded, check
from trainwarden.supervisor.enums import SupervisorEvent
from trainwarden.supervisor.store.tables import (
    events,
)


@dataclass(frozen=True)
class IngestConfig:
    SECTION: ClassVar[str] = "ingest"

    # An agent timestamp (t of a step, event, checkpoint, exit, heartbeat; a batch's sent_at)
    # more than this many seconds ahead of the supervisor's clock is replaced by the receive
    # time (and counted in a clock_skew event).  1 day: a clock an hour or a time zone off
    # (up to 14 h) still passes, a clock years ahead does not
    clock_ahead_s: float = bounded(86_400.0, gt=0, finite=True)
    # An agent timestamp more than this many seconds behind the supervisor's clock is
    # replaced the same way.  30 days: an agent cut off for weeks replays its spool with the
    # true times; a clock at 1970 (no RTC, no NTP) is caught
    clock_behind_s: float = bounded(30 * 86_400.0, gt=0, finite=True)

    def __post_init__(self) -> None:
        check(self)



DEFAULT = IngestConfig()

# One clock_skew event per agent per this many seconds (of the supervisor's clock); the
# timestamps replaced meanwhile are added to its count.
CLOCK_SKEW_EVENT_S = 3600.0


class ClockCheck:
    """One batch's agent timestamps against the supervisor's clock: a time that is not
    finite, or further off than the configured skew, becomes the receive time."""

    def __init__(self, now: float, cfg: IngestConfig) -> None:
        self.now = now
        self.lo, self.hi = now - cfg.clock_behind_s, now + cfg.clock_ahead_s
        self.replaced: dict[str, int] = {}
        self.worst: float | None = None  # the replaced value furthest off (finite ones)
        self.nonfinite = 0

    def t(self, value: float | None, default: float, what: str) -> float:
        if value is None:
            return default
        if self.lo <= value <= self.hi:  # (False for NaN)
            return value
        self.replaced[what] = self.replaced.get(what, 0) + 1
        if not math.isfinite(value):
            self.nonfinite += 1
        elif self.worst is None or abs(value - self.now) > abs(self.worst - self.now):
            self.worst = value
        return self.now


def count_clock_skew(conn: Connection, *, run_id: int, agent_id: int, attempt: int,
                      clk: ClockCheck, now: float) -> None:
    """Count a batch's replaced timestamps in the agent's ``clock_skew`` event: the one of
    the last ``CLOCK_SKEW_EVENT_S`` if there is one (a skewed clock skews every batch: one
    event an hour, not one a second), else a new one."""
    ev = events.c
    prev = conn.execute(
        select(ev.id, ev.details).where(ev.run_id == run_id, ev.agent_id == agent_id,
                                        ev.name == SupervisorEvent.CLOCK_SKEW,
                                        ev.t >= now - CLOCK_SKEW_EVENT_S)
        .order_by(ev.id.desc()).limit(1)).first()
    old = prev[1] if prev is not None and isinstance(prev[1], dict) else {}
    fields = dict(old.get("fields") or {}) if isinstance(old.get("fields"), dict) else {}
    for k, n in clk.replaced.items():
        fields[k] = int(fields.get(k) or 0) + n
    count = sum(int(v) for v in fields.values() if isinstance(v, int))
    worst = old.get("worst_offset_s")
    if clk.worst is not None:
        off = clk.worst - now
        if not isinstance(worst, int | float) or abs(off) > abs(worst):
            worst = off
    details = {
        "count": count, "fields": fields,
        "nonfinite": int(old.get("nonfinite") or 0) + clk.nonfinite,
        "worst_offset_s": worst, "ahead_s": clk.hi - now, "behind_s": now - clk.lo,
        "first_at": old.get("first_at", now), "last_at": now,
    }
    message = (f"{count} agent timestamp(s) not finite or off the supervisor's clock by more "
               f"than {clk.hi - now:g} s ahead / {now - clk.lo:g} s behind: stored as the "
               "receive time")
    if prev is not None:
        conn.execute(update(events).where(ev.id == prev[0])
                     .values(details=details, message=message))
    else:
        conn.execute(events.insert().values(
            run_id=run_id, agent_id=agent_id, attempt=attempt, rank=None, t=now,
            name=SupervisorEvent.CLOCK_SKEW, step=None, message=message, details=details))

"""Node lost: an agent silent past its heartbeat deadline.

Agents send a heartbeat with every ingest batch (about once a second, and at least every
heartbeat interval).  A node whose newest heartbeat is older than ``deadline_s`` is lost: the
machine died, the network split, or the agent hung.  ``deadline_s = 30`` is many heartbeat
intervals (one missed batch, or a busy supervisor answering late, is not a loss) yet well
under a minute, so a gang restart is not held up long.

Pass heartbeat times as the *supervisor* saw them (receive time), so node clock skew cannot
matter, and ``observing_since`` = the supervisor's own start time: a supervisor that was down
cannot tell a lost node from its own absence, so every node gets a full deadline after it
comes back.  Pass only the nodes that should be alive (not those whose agents finished or
were stopped on purpose).

Silence and a peer's failure together confirm a death sooner: when the workers of a surviving
node fail on their connection to a peer (reset, closed, refused) and a member has been silent
for ``confirm_s`` (a few heartbeat intervals), that member is dead (``silent_members``; the
policy's ``node_death``).  Silence alone never does: a busy or briefly paused node is not
replaced for nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

from trainwarden.agent.core.bounds import bounded, check
from trainwarden.supervisor.detect.findings import INCIDENT, Finding, FindingKind


@dataclass(frozen=True)
class NodeLostConfig:
    SECTION: ClassVar[str] = "node_lost"

    # seconds without a heartbeat before a node is lost (also how long a rendezvous host's
    # failure is held for the report of a heard member that did not join)
    deadline_s: float = bounded(30.0, gt=0, hint="try 30")
    # seconds of silence that confirm a node's death at once when its peers' workers failed
    # on their connections to it (heartbeat silence alone waits for deadline_s; never more
    # than deadline_s)
    confirm_s: float = bounded(5.0, gt=0, hint="try 5 (a few heartbeat intervals)")
    # how long a survivor's failure on a lost peer connection is held, waiting for a silent
    # peer, before it is judged as an ordinary crash
    confirm_wait_s: float = bounded(10.0, ge=0, hint="try 10")

    def __post_init__(self) -> None:
        check(self)


def detect_lost_nodes(last_heartbeat: Mapping[str, float], now: float,
                      cfg: NodeLostConfig | None = None, *,
                      observing_since: float | None = None,
                      ranks: Mapping[str, list[int]] | None = None,
                      down: Mapping[str, str] | None = None) -> list[Finding]:
    """One ``node_lost`` incident per node (sorted by name) silent for more than the deadline,
    or silent for ``confirm_s`` while the scheduler that owns it says it is down (``down``:
    node -> the scheduler's words; its word and the silence confirm the death together).

    ``last_heartbeat``: node -> unix time of its newest heartbeat.  ``ranks``: node -> ranks
    it runs (optional, for the message)."""
    cfg = cfg or NodeLostConfig()
    out = []
    for node, t in sorted(last_heartbeat.items()):
        since = t if observing_since is None else max(t, observing_since)
        age = now - since
        said = (down or {}).get(node)
        confirmed = said is not None and age >= min(cfg.confirm_s, cfg.deadline_s)
        if age <= cfg.deadline_s and not confirmed:
            continue
        on = (ranks or {}).get(node)
        rank_txt = f" (ranks {', '.join(map(str, on))})" if on else ""
        details: dict[str, object] = {"last_heartbeat": t, "age_s": round(now - t, 3),
                                      "deadline_s": cfg.deadline_s, "ranks": list(on or [])}
        if age <= cfg.deadline_s:
            msg = (f"node {node}{rank_txt} lost: no heartbeat for {now - t:.1f} s, and its "
                   f"scheduler says it is down ({said})")
            details.update(confirmed_by="scheduler", scheduler=said)
        else:
            msg = (f"node {node}{rank_txt} lost: no heartbeat for {now - t:.1f} s "
                   f"(deadline {cfg.deadline_s:g} s)")
        out.append(Finding(kind=FindingKind.NODE_LOST, severity=INCIDENT, message=msg, node=node,
                           started_at=t, details=details))
    return out


def agents_gone(newest_heartbeat: float | None, now: float, cfg: NodeLostConfig | None = None,
                *, observing_since: float | None = None) -> bool:
    """No agent of a run has run for the deadline: its newest heartbeat (of any agent, as
    the supervisor received it) is older than ``deadline_s``, and the supervisor has been
    watching that long itself (``observing_since``, as above).  A run with no agent: False."""
    cfg = cfg or NodeLostConfig()
    if newest_heartbeat is None:
        return False
    since = newest_heartbeat if observing_since is None else max(newest_heartbeat,
                                                                 observing_since)
    return now - since > cfg.deadline_s


def silent_members(last_heartbeat: Mapping[str, float], now: float,
                   cfg: NodeLostConfig | None = None, *,
                   observing_since: float | None = None) -> dict[str, float]:
    """node -> seconds since heard, of the nodes silent for at least ``confirm_s`` (at most
    the deadline; as the supervisor received their heartbeats; a supervisor that just came
    back has not been watching long enough to tell)."""
    cfg = cfg or NodeLostConfig()
    confirm = min(cfg.confirm_s, cfg.deadline_s)
    out: dict[str, float] = {}
    for node, t in sorted(last_heartbeat.items()):
        since = t if observing_since is None else max(t, observing_since)
        if now - since >= confirm:
            out[node] = round(now - t, 3)
    return out

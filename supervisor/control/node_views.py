"""A run's nodes as the API, ``trainwarden nodes`` and the dashboard show them: the store's
facts about each agent, judged once by ``node_states`` (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from trainwarden.agent.core.states import NodeRole
from trainwarden.supervisor.control.membership import Capacity
from trainwarden.supervisor.control.node_states import NodeFacts, NodeView, RunFacts, node_view
from trainwarden.supervisor.enums import FINAL_STATUSES
from trainwarden.supervisor.store import reads
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import AgentRow, RunRow


def node_views(conn: Connection, *, run: RunRow, agents: Sequence[AgentRow], now: float,
               live_s: float, capacity: Capacity) -> dict[int, NodeView]:
    """agent id -> its node's view (``capacity``: the run's, ``actions.capacity``: whether
    a node rank waits for a node)."""
    run_id = int(run["id"])
    replaced = reads.replaced_nodes(conn, run_id=run_id)
    lost = reads.lost_nodes(conn, run_id=run_id)
    facts = RunFacts(now=now, live_s=live_s, ended=run["status"] in FINAL_STATUSES,
                     waiting=bool(capacity.missing))
    out = {}
    for a in agents:
        try:
            role = NodeRole(a["role"])
        except ValueError:
            role = NodeRole.SPARE
        out[int(a["id"])] = node_view(NodeFacts(
            role=role, reported=str(a["state"] or ""), last_seen_at=float(a["last_seen_at"]),
            replaced=a["node"] in replaced, lost_at=lost.get(str(a["node"]))), facts)
    return out

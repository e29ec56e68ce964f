"""A run's nodes as the API, ``trainwarden nodes`` and the dashboard show them: the store's
facts about each agent, judged once by ``node_states`` (pure); and the run's condition
(``run_condition``: waiting for a node, or shrunk)."""

from __future__ import annotations

from collections.abc import Sequence

from trainwarden.agent.core.states import NodeRole
from trainwarden.supervisor.control.membership import Capacity
from trainwarden.supervisor.control.node_states import NodeFacts, NodeView, RunFacts, node_view
from trainwarden.supervisor.control.run_condition import RunCondition, run_condition
from trainwarden.supervisor.enums import FINAL_STATUSES, SupervisorEvent
from trainwarden.supervisor.store import membership as store_membership
from trainwarden.supervisor.store import reads, windows
from trainwarden.supervisor.store import recovery as rec
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
            replaced=a["node"] in replaced,
            # (its death confirmed, kept with the agent; else an open node-lost incident's)
            lost_at=_confirmed(a) or lost.get(str(a["node"]))), facts)
    return out


def _confirmed(a: AgentRow) -> float | None:
    t = dict(a).get("lost_at")
    return float(t) if isinstance(t, int | float) else None


def condition_of(conn: Connection, *, run: RunRow) -> RunCondition | None:
    """The run's condition (``run_condition``) from the store: the node ranks its current
    attempt's restart waits on (and why, from the ``waiting_for_node`` event), and its
    world against the declared one (since the newest ``world_resized`` event)."""
    run_id = int(run["id"])
    m = store_membership.run_membership(conn, run_id=run_id)
    action = rec.restart_action_for(conn, run_id=run_id, attempt=int(run["attempt"]))
    plan = (action["plan"] or {}).get("membership") if action is not None else None
    ranks = [int(k) for k in (plan or {}).get("waiting") or []] if isinstance(plan, dict) else []
    why: dict[str, object] = {}
    waiting_since = None
    requeued = ""
    if ranks:
        req = windows.latest_run_event(conn, run_id=run_id, name=SupervisorEvent.REQUEUED)
        said = req["details"] if req is not None and isinstance(req["details"], dict) else {}
        if said.get("ok") and said.get("attempt") == int(run["attempt"]):
            without = said.get("excluded") or said.get("drained") or []
            requeued = f"job {said.get('job')} was requeued without " \
                f"{', '.join(map(str, without))}"
        ev = windows.latest_run_event(conn, run_id=run_id, name=SupervisorEvent.WAITING_FOR_NODE)
        if ev is not None:
            waiting_since = float(ev["t"])
            details = ev["details"] if isinstance(ev["details"], dict) else {}
            given = details.get("waiting")
            why = given if isinstance(given, dict) else {}
    resized = windows.latest_run_event(conn, run_id=run_id, name=SupervisorEvent.WORLD_RESIZED)
    return run_condition(
        status=str(run["status"]),
        waiting={k: str(why.get(str(k), "vacant")) for k in ranks},
        spares_configured=any(n["joined_as"] == NodeRole.SPARE for n in m["nodes"]),
        world=m["world"], declared=m["nnodes"], waiting_since=waiting_since,
        shrunk_since=float(resized["t"]) if resized is not None else None,
        requeued=requeued)

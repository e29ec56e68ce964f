"""The commands an ingest reply carries (every unacknowledged one, re-sent until the agent
acknowledges it) and the agents' results for them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    bindparam,
    literal_column,
    select,
    update,
)

from trainwarden.agent.core.states import CommandStatus
from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.enums import SupervisorEvent
from trainwarden.supervisor.store.ingest.statements import HotSQL
from trainwarden.supervisor.store.tables import (
    commands,
    events,
)


def pending_commands(conn: Connection, hot: HotSQL, cur: Any, agent_ids: list[int], now: float
             ) -> dict[int, list[dict[str, Any]]]:
    if len(agent_ids) != 1:
        return _pending_many(conn, agent_ids=agent_ids, now=now)
    rows = [
        {"id": r[0], "kind": r[1], "attempt": r[2],
         "plan": json.loads(r[3]) if isinstance(r[3], str | bytes) else r[3],
         "not_before": r[4], "reason": r[5], "collect_stacks": bool(r[6])}
        for r in hot.fetchall(cur, "pending", {"agent_id": agent_ids[0]})
    ]
    if rows:
        _mark_sent(conn, ids=[c["id"] for c in rows], now=now)
    return {agent_ids[0]: rows} if rows else {}


_PENDING_MANY = (
    select(commands.c.agent_id, commands.c.id, commands.c.kind, commands.c.attempt,
           commands.c.plan, commands.c.not_before, commands.c.reason,
           commands.c.collect_stacks)
    .where(commands.c.agent_id.in_(bindparam("ids", expanding=True)),
           commands.c.status == literal_column(f"'{CommandStatus.PENDING}'"))
    .order_by(commands.c.id)
)


def _mark_sent(conn: Connection, *, ids: list[int], now: float) -> None:
    conn.execute(
        update(commands)
        .where(commands.c.id.in_(ids))
        .values(sent_count=commands.c.sent_count + 1, updated_at=now)
    )


def _pending_many(
    conn: Connection, *, agent_ids: Sequence[int], now: float
) -> dict[int, list[dict[str, Any]]]:
    """Unacknowledged commands of several agents (re-sent with every reply), by agent."""
    if not agent_ids:
        return {}
    out: dict[int, list[dict[str, Any]]] = {}
    for r in conn.execute(_PENDING_MANY, {"ids": list(agent_ids)}):
        d = dict(r._mapping)
        out.setdefault(int(d.pop("agent_id")), []).append(d)
    if out:
        _mark_sent(conn, ids=[c["id"] for cs in out.values() for c in cs], now=now)
    return out


def apply_command_result(
    conn: Connection,
    *,
    agent_id: int,
    run_id: int,
    item: wire.CommandResultItem,
    now: float,
    t: float,
) -> None:
    # Only the agent's own commands; "done"/"failed" are final, a late "delivered" after them
    # must not move the status back.
    cond = [commands.c.id == item.command_id, commands.c.agent_id == agent_id]
    if CommandStatus(item.status) is CommandStatus.DELIVERED:
        cond.append(commands.c.status == CommandStatus.PENDING)
    res = conn.execute(
        update(commands).where(*cond).values(status=item.status, detail=item.detail,
                                             updated_at=now)
    )
    if res.rowcount == 0:
        known = conn.execute(
            select(commands.c.id).where(
                commands.c.id == item.command_id, commands.c.agent_id == agent_id
            )
        ).first()
        if known is None:
            # Not this agent's command: keep a trace, store nothing else.
            conn.execute(events.insert().values(
                run_id=run_id, agent_id=agent_id, attempt=0, rank=None, t=t,
                name=SupervisorEvent.UNKNOWN_COMMAND_RESULT, step=None,
                message=f"command_result for command {item.command_id} not sent to this agent",
                details={"status": item.status, "detail": item.detail},
            ))

"""Membership: which agent of a run is node rank k (a member) and which runs nothing (a spare),
and the run's membership epoch.  Keyword-only functions taking a ``Connection``.

The policy decides each attempt's members (``trainwarden.supervisor.control.membership``);
this module only records and reads them.  Registration admits a new node as a member while
the world its torchrun command declares (``--nnodes``) has a free node rank, else as a spare;
a node that registers again keeps what it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from sqlalchemy import Connection, select, update

from trainwarden.agent.core.launch import declared_nnodes, endpoint, rendezvous_port
from trainwarden.agent.core.states import NodeRole
from trainwarden.supervisor.store.tables import agents, runs


class Node(TypedDict):
    """One agent of a run as membership sees it."""

    agent_id: int
    node: str
    role: NodeRole
    node_rank: int | None
    address: str
    last_seen_at: float
    state: str
    command: list[str]
    nproc_per_node: int | None
    devices: int | None
    joined_as: NodeRole


class RunMembership(TypedDict):
    epoch: int
    nnodes: int | None  # None: the command declares no world (not a torchrun launch)
    world: int | None  # the nodes the current attempt runs on (None: ``nnodes``)
    min_nodes: int | None  # the smallest world the run accepts (None: ``nnodes``)
    members: dict[int, Node]  # node rank -> its member
    spares: list[Node]  # in registration order
    nodes: list[Node]  # every agent of the run, in registration order


def _node(r: Any) -> Node:
    return {"agent_id": int(r.id), "node": r.node, "role": NodeRole(r.role),
            "node_rank": r.node_rank, "address": r.address or "",
            "last_seen_at": float(r.last_seen_at or 0.0), "state": r.state or "",
            "command": [str(a) for a in (r.command or [])],
            "nproc_per_node": r.nproc_per_node, "devices": r.devices,
            "joined_as": NodeRole(r.joined_as)}


def run_membership(conn: Connection, *, run_id: int) -> RunMembership:
    a = agents.c
    rows = conn.execute(
        select(a.id, a.node, a.role, a.node_rank, a.address, a.last_seen_at, a.state, a.command,
               a.nproc_per_node, a.devices, a.joined_as)
        .where(a.run_id == run_id).order_by(a.id)).all()
    head = conn.execute(select(runs.c.epoch, runs.c.nnodes, runs.c.world_nnodes,
                               runs.c.min_nodes).where(runs.c.id == run_id)).one()
    nodes = [_node(r) for r in rows]
    members = {n["node_rank"]: n for n in nodes
               if n["role"] == NodeRole.MEMBER and n["node_rank"] is not None}
    return {"epoch": int(head.epoch or 0), "nnodes": head.nnodes, "world": head.world_nnodes,
            "min_nodes": head.min_nodes, "members": members,
            "spares": [n for n in nodes if n["role"] == NodeRole.SPARE], "nodes": nodes}


def admit(conn: Connection, *, run_id: int, agent_id: int, command: Sequence[str],
          spare: bool, new: bool, min_nodes: int | None = None) -> None:
    """Decide what a registering agent is.  A node registering again (``new`` False) keeps its
    role and node rank.  A new one asking to be a spare is one; otherwise it takes the lowest
    free node rank of the current world (the declared one, or fewer after a shrink), and
    becomes a spare when there is none.  ``min_nodes``, when given, is the run's from now on
    (the newest registration's)."""
    if min_nodes is not None:
        conn.execute(update(runs).where(runs.c.id == run_id).values(min_nodes=min_nodes))
    if not new:
        return
    run = conn.execute(select(runs.c.nnodes, runs.c.world_nnodes)
                       .where(runs.c.id == run_id)).one()
    nnodes = run.world_nnodes if run.world_nnodes is not None else run.nnodes
    if nnodes is None and not spare:
        nnodes = declared_nnodes(list(command))
        if nnodes is not None:
            conn.execute(update(runs).where(runs.c.id == run_id).values(nnodes=nnodes))
    role, rank = NodeRole.SPARE, None
    if not spare:
        held = {int(r[0]) for r in conn.execute(
            select(agents.c.node_rank).where(agents.c.run_id == run_id,
                                             agents.c.role == NodeRole.MEMBER,
                                             agents.c.node_rank.is_not(None),
                                             agents.c.id != agent_id))}
        free = [k for k in range(nnodes if nnodes is not None else len(held) + 1)
                if k not in held]
        if free:
            role, rank = NodeRole.MEMBER, free[0]
    conn.execute(update(agents).where(agents.c.id == agent_id)
                 .values(role=role, node_rank=rank,
                         joined_as=NodeRole.SPARE if spare else NodeRole.MEMBER))


def assign(conn: Connection, *, run_id: int, members: Mapping[int, int], epoch: int,
           world: int | None = None) -> None:
    """Record an attempt's members (node rank -> agent id), the membership epoch and the
    attempt's world (None: the declared one): every other agent of the run is a spare from
    now on."""
    chosen = {aid: rank for rank, aid in members.items()}
    for r in conn.execute(select(agents.c.id).where(agents.c.run_id == run_id)):
        aid = int(r[0])
        if aid in chosen:
            values: dict[str, Any] = {"role": NodeRole.MEMBER, "node_rank": chosen[aid]}
        else:
            values = {"role": NodeRole.SPARE, "node_rank": None}
        conn.execute(update(agents).where(agents.c.id == aid).values(**values))
    conn.execute(update(runs).where(runs.c.id == run_id).values(epoch=epoch,
                                                                world_nnodes=world))


def rendezvous(m: RunMembership) -> str | None:
    """The static rendezvous endpoint of the current membership: the address of the member
    holding node rank 0, at its command's port moved by the epoch; None when node rank 0 has
    no member or the command declares no world."""
    host = m["members"].get(0)
    if host is None or m["nnodes"] is None or not host["address"]:
        return None
    return endpoint(host["address"], rendezvous_port(host["command"]), m["epoch"])


def member_view(m: RunMembership, *, agent_id: int) -> dict[str, Any]:
    """What one agent is told of the membership (the registration and ingest replies)."""
    me = next((n for n in m["nodes"] if n["agent_id"] == agent_id), None)
    return {"role": me["role"] if me else NodeRole.SPARE,
            "node_rank": me["node_rank"] if me else None,
            "nnodes": m["world"] if m["world"] is not None else m["nnodes"],
            "declared": m["nnodes"], "epoch": m["epoch"], "endpoint": rendezvous(m)}

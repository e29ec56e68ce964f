"""Membership: which agent of a run is node rank k (a member) and which runs nothing (a spare),
and the run's membership epoch.  Keyword-only functions taking a ``Connection``.

The policy decides each attempt's members (``trainwarden.supervisor.control.membership``);
this module only records and reads them.  Registration admits a new node as a member while
the world its torchrun command declares (``--nnodes``) has a free node rank, else as a spare;
a node that registers again keeps what it was.  The run's settings are its first member's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from sqlalchemy import Connection, select, update

from trainwarden.agent.core.launch import (
    declared_nnodes,
    endpoint,
    launcher_args,
    rendezvous_port,
)
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
    lost_at: float | None  # its death confirmed then (not fit to run until heard after it)


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
            "joined_as": NodeRole(r.joined_as),
            "lost_at": None if r.lost_at is None else float(r.lost_at)}


def run_membership(conn: Connection, *, run_id: int) -> RunMembership:
    a = agents.c
    rows = conn.execute(
        select(a.id, a.node, a.role, a.node_rank, a.address, a.last_seen_at, a.state, a.command,
               a.nproc_per_node, a.devices, a.joined_as, a.lost_at)
        .where(a.run_id == run_id).order_by(a.id)).all()
    head = conn.execute(select(runs.c.epoch, runs.c.nnodes, runs.c.world_nnodes,
                               runs.c.min_nodes).where(runs.c.id == run_id)).one()
    nodes = [_node(r) for r in rows]
    members = {n["node_rank"]: n for n in nodes
               if n["role"] == NodeRole.MEMBER and n["node_rank"] is not None}
    return {"epoch": int(head.epoch or 0), "nnodes": head.nnodes, "world": head.world_nnodes,
            "min_nodes": head.min_nodes, "members": members,
            "spares": [n for n in nodes if n["role"] == NodeRole.SPARE], "nodes": nodes}


class SettingsConflict(Exception):
    """A registration whose run-level setting disagrees with the run's (fixed by its first
    member): refused, nothing changed.  The message names the field and both values."""


def lowest_free(held: Sequence[int]) -> int:
    """The lowest node rank not in ``held`` (work grows with the members, never with the
    declared world)."""
    k = 0
    for rank in sorted(set(held)):
        if rank != k:
            break
        k += 1
    return k


def _settings_conflict(run: Any, *, launcher: str, declared: int | None,
                       min_nodes: int | None) -> str | None:
    """Why a registration disagrees with the run's settings (None: it agrees).  A
    registration that gives no ``min_nodes`` takes the run's."""
    first = "fixed by the run's first member"
    if launcher != run.launcher:
        return (f"command: the run's members run a {run.launcher} command ({first}); this "
                f"registration's is a {launcher} one: register with the run's command")
    if launcher == "torchrun" and declared != run.nnodes:
        return (f"--nnodes: the run declares {run.nnodes} node(s) ({first}); this registration "
                f"declares {declared}: register with --nnodes={run.nnodes}")
    if min_nodes is not None and min_nodes != run.min_nodes:
        theirs = run.min_nodes if run.min_nodes is not None else "none (it never shrinks)"
        return (f"min_nodes: the run's is {theirs} ({first}); this registration asks "
                f"{min_nodes}: drop --min-nodes, or give the run's")
    return None


def admit(conn: Connection, *, run_id: int, agent_id: int, command: Sequence[str],
          spare: bool, new: bool, min_nodes: int | None = None) -> NodeRole:
    """Decide what a registering agent is; returns its role.

    The run's settings (the shape of its command: a torchrun launch or not, the declared
    world ``--nnodes``, and ``min_nodes``) are fixed by its first member; a later
    registration, member or spare, that disagrees raises ``SettingsConflict`` (nothing is
    changed: the caller's transaction is rolled back).  A node registering again (``new``
    False) keeps its role and node rank.  A new one asking to be a spare is one; otherwise it
    takes the lowest free node rank of the current world (the declared one, or fewer after a
    shrink), and becomes a spare when there is none."""
    run = conn.execute(select(runs.c.nnodes, runs.c.world_nnodes, runs.c.min_nodes,
                              runs.c.launcher).where(runs.c.id == run_id)).one()
    launcher = "plain" if launcher_args(list(command)) is None else "torchrun"
    declared = declared_nnodes(list(command))
    if run.launcher is not None:
        why = _settings_conflict(run, launcher=launcher, declared=declared,
                                 min_nodes=min_nodes)
        if why is not None:
            raise SettingsConflict(why)
    if not new:
        return NodeRole(conn.execute(select(agents.c.role)
                                     .where(agents.c.id == agent_id)).scalar_one())
    if spare:
        role, rank = NodeRole.SPARE, None
    else:
        if run.launcher is None:  # the first member: the run's settings are its
            conn.execute(update(runs).where(runs.c.id == run_id).values(
                launcher=launcher, nnodes=declared if launcher == "torchrun" else None,
                min_nodes=min_nodes))
            nnodes = declared if launcher == "torchrun" else None
        else:
            nnodes = run.world_nnodes if run.world_nnodes is not None else run.nnodes
        held = [int(r[0]) for r in conn.execute(
            select(agents.c.node_rank).where(agents.c.run_id == run_id,
                                             agents.c.role == NodeRole.MEMBER,
                                             agents.c.node_rank.is_not(None),
                                             agents.c.id != agent_id))]
        free = lowest_free(held)
        role, rank = ((NodeRole.MEMBER, free) if nnodes is None or free < nnodes
                      else (NodeRole.SPARE, None))
    conn.execute(update(agents).where(agents.c.id == agent_id)
                 .values(role=role, node_rank=rank,
                         joined_as=NodeRole.SPARE if spare else NodeRole.MEMBER))
    return role


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


def confirm_lost(conn: Connection, *, run_id: int, nodes: Sequence[str], now: float) -> None:
    """These nodes' deaths are confirmed now: not fit to run until heard from again."""
    if nodes:
        conn.execute(update(agents).where(agents.c.run_id == run_id,
                                          agents.c.node.in_(list(nodes)))
                     .values(lost_at=now))


def confirmed_lost(n: Node) -> bool:
    """Whether a node's death was confirmed and it has not been heard from since."""
    return n["lost_at"] is not None and n["last_seen_at"] <= n["lost_at"]


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

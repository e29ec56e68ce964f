"""Runs and agents: registration, the run's status, its agents.  Keyword-only functions taking
a ``Connection``."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, Literal, cast

from sqlalchemy import Connection, func, or_, select, update

from trainwarden.agent.core.launch import min_nodes_refused, unrewritable
from trainwarden.agent.core.states import AgentState, NodeRole
from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.enums import (
    ACTIVE_STATUSES,
    FINAL_STATUSES,
    RUN_TRANSITIONS,
    PresenceEvent,
    RunStatus,
)
from trainwarden.supervisor.store import credentials, membership
from trainwarden.supervisor.store._sql import insert, row
from trainwarden.supervisor.store.credentials import NodeHolder
from trainwarden.supervisor.store.health import gpu_health, worker_stats
from trainwarden.supervisor.store.rows import AgentAttemptRow, AgentRow, RegisteredAgent, RunRow
from trainwarden.supervisor.store.tables import agents, events, ingested_batches, runs


class RunFinished(Exception):
    """Registration for a run that has ended (completed, failed or stopped): a finished run
    is never silently reopened, and a new run under its name would inherit its records."""

    def __init__(self, name: str, status: str, reason: str) -> None:
        self.name, self.status, self.reason = name, status, reason
        why = f" ({reason})" if reason else ""
        super().__init__(
            f"run {name!r} has already {status}{why}; a finished run is not reopened by a new "
            f"agent. Start a new run under another name (for example --run {name}-2); to "
            "continue training from this run's checkpoints, give the new run the same "
            "checkpoint directory (its workers resume from the newest complete checkpoint)")


class RunTransitionRefused(Exception):
    """A run status change the transition table (``enums.RUN_TRANSITIONS``) does not list:
    nothing is changed."""

    def __init__(self, run_id: int, status: str, to: str) -> None:
        self.run_id, self.status, self.to = run_id, status, to
        allowed = ", ".join(sorted(RUN_TRANSITIONS.get(RunStatus(status), ()))) or "none"
        super().__init__(f"run {run_id} is {status}: it may not become {to} "
                         f"(it may become: {allowed})")


class CommandRefused(Exception):
    """Registration with a training command the agent cannot rewrite for the members the
    supervisor decides (``trainwarden.agent.core.launch.unrewritable``): the message names
    the fix, and nothing is changed."""


Claim = Literal["new", "proven", "expired", "free", "takeover"]
"""How a registration claims its (run, node): the first agent there, the holder proving its
credential, a new incarnation after the holder went silent, a node whose credential an
operator revoked (or registered before agents had credentials), or an operator's takeover
(a live holder's credential revoked)."""


def register_agent(conn: Connection, *, req: wire.RegisterRequest, now: float,
                   judge: Callable[[NodeHolder | None], Claim] | None = None,
                   peer: str = "", host_trusted: bool = True) -> RegisteredAgent:
    """Create the run (with a new uuid) and the agent if new (an agent re-registering keeps
    its id).  ``judge`` decides on the (run, node)'s current holder (it raises to refuse: the
    caller's transaction then changes nothing; without one, every registration is a new
    incarnation).  Every claim but ``proven`` issues a new
    credential (the reply's ``credential``; None: the presented one stays valid) and revokes
    the old one.  A new node becomes a member while the declared world has a free node rank,
    else a spare (``membership.admit``); its rendezvous address is the one it gives, else
    ``peer`` (the address its request came from).  A spare never makes a run running: a run
    a spare registers first is ``pending`` until its first member registers.
    ``host_trusted``: the registering token is trusted for the node's host (its evidence
    moves the shared health ledger).  Raises ``RunFinished`` for a run that has ended,
    ``CommandRefused`` for a command that cannot be rewritten, ``membership.SettingsConflict``
    for a run-level setting that disagrees with the run's: nothing is changed then."""
    address = req.address or peer
    ins = insert(conn, runs).values(
        name=req.run, uuid=str(uuid.uuid4()),
        status=RunStatus.PENDING if req.spare else RunStatus.RUNNING, attempt=0,
        restarts=0, reason="", created_at=now, updated_at=now,
    )
    conn.execute(ins.on_conflict_do_nothing(index_elements=["name"]))
    run = conn.execute(
        select(runs.c.id, runs.c.uuid, runs.c.attempt, runs.c.status, runs.c.reason)
        .where(runs.c.name == req.run)
    ).one()
    if run.status in FINAL_STATUSES:
        raise RunFinished(req.run, run.status, run.reason)
    why = unrewritable(list(req.command)) or min_nodes_refused(req.min_nodes,
                                                                list(req.command))
    if why is not None:
        raise CommandRefused(f"run {req.run!r}, node {req.node!r}: {why}")
    holder = credentials.node_holder(conn, run_id=run.id, node=req.node)
    new = conn.execute(select(agents.c.id).where(agents.c.run_id == run.id,
                                                 agents.c.node == req.node)).first() is None
    claim: Claim = judge(holder) if judge is not None else ("new" if holder is None
                                                             else "expired")
    values = {
        "hostname": req.hostname, "pid": req.pid, "command": list(req.command),
        "nproc_per_node": req.nproc_per_node,
        # (normalised by the request's model; the first is kept where older readers look)
        "checkpoint_roots": list(req.checkpoint_roots),
        "checkpoint_root": req.checkpoint_roots[0] if req.checkpoint_roots else None,
        "agent_version": req.agent_version, "last_seen_at": now,
        "state": AgentState.REGISTERED,
        "address": address, "devices": req.devices, "host_trusted": host_trusted,
    }
    ins = insert(conn, agents).values(
        run_id=run.id, node=req.node, registered_at=now, dropped=0, **values
    )
    conn.execute(ins.on_conflict_do_update(index_elements=["run_id", "node"], set_=values))
    agent_id = conn.execute(
        select(agents.c.id).where(agents.c.run_id == run.id, agents.c.node == req.node)
    ).scalar_one()
    role = membership.admit(conn, run_id=run.id, agent_id=agent_id, command=list(req.command),
                            spare=req.spare, new=new, min_nodes=req.min_nodes)
    # (pending -> running, one of ``RUN_TRANSITIONS``: only from pending, so a concurrent
    # move of the run wins)
    if role == NodeRole.MEMBER and run.status == RunStatus.PENDING:
        conn.execute(update(runs).where(runs.c.id == run.id, runs.c.status == RunStatus.PENDING)
                     .values(status=RunStatus.RUNNING, updated_at=now,
                             reason=f"its first member ({req.node}) registered"))
    # When the run's agents ran is read from these (``PresenceEvent``): its idle time.
    conn.execute(events.insert().values(
        run_id=run.id, agent_id=agent_id, attempt=run.attempt, rank=None, t=now,
        name=PresenceEvent.AGENT_REGISTERED, step=None,
        message=f"agent on {req.node} registered ({req.hostname}, pid {req.pid})",
        details={"node": req.node, "hostname": req.hostname, "pid": req.pid,
                 "scheduler_job": req.scheduler_job}))
    secret = None if claim == "proven" else credentials.issue(conn, agent_id=agent_id, now=now)
    max_seq = conn.execute(
        select(func.max(ingested_batches.c.seq)).where(ingested_batches.c.agent_id == agent_id)
    ).scalar_one()
    reg: RegisteredAgent = {
        "agent_id": agent_id,
        "run_id": run.id,
        "run_uuid": run.uuid,
        "attempt": run.attempt,
        "next_seq": 0 if max_seq is None else int(max_seq) + 1,
        "credential": secret,
        "claim": claim,
        "holder": holder,
        "membership": membership.member_view(membership.run_membership(conn, run_id=run.id),
                                             agent_id=agent_id),
    }
    return reg


def _run(r: Any) -> RunRow:
    d = cast(RunRow, row(r))
    if d["protected"] is not None:  # checkpoint paths: text only, whatever the row holds
        d["protected"] = [p for p in d["protected"] if isinstance(p, str)]
    return d


def get_run_by_name(conn: Connection, *, name: str) -> RunRow | None:
    if "\x00" in name:  # no run has one (registration refuses it); Postgres text cannot hold it
        return None
    r = conn.execute(select(runs).where(runs.c.name == name)).first()
    return _run(r) if r else None


def get_run(conn: Connection, *, run_id: int) -> RunRow:
    return _run(conn.execute(select(runs).where(runs.c.id == run_id)).one())


def list_runs(conn: Connection) -> list[RunRow]:
    return [_run(r) for r in conn.execute(select(runs).order_by(runs.c.id))]


def active_runs(conn: Connection) -> list[RunRow]:
    """The runs the evaluator watches: running or restarting."""
    q = select(runs).where(runs.c.status.in_(list(ACTIVE_STATUSES))).order_by(runs.c.id)
    return [_run(r) for r in conn.execute(q)]


def runs_for_metrics(conn: Connection, *, since: float) -> list[RunRow]:
    """Active runs, and the runs whose status changed at or after ``since``."""
    q = select(runs).where(or_(runs.c.status.in_(list(ACTIVE_STATUSES)),
                               runs.c.updated_at >= since))
    return [_run(r) for r in conn.execute(q.order_by(runs.c.id))]


def set_run_status(
    conn: Connection,
    *,
    run_id: int,
    status: str,
    now: float,
    reason: str | None = None,
    attempt: int | None = None,
    restarts: int | None = None,
) -> None:
    """Move the run to ``status``, from a status the transition table lets reach it (one
    statement: a concurrent move is seen).  A move it does not list raises
    ``RunTransitionRefused`` and changes nothing; a run that does not exist is left alone."""
    to = RunStatus(status)
    sources = [s for s, targets in RUN_TRANSITIONS.items() if to in targets]
    values: dict[str, Any] = {"status": to, "updated_at": now}
    if reason is not None:
        values["reason"] = reason
    if attempt is not None:
        values["attempt"] = attempt
    if restarts is not None:
        values["restarts"] = restarts
    moved = conn.execute(update(runs).where(runs.c.id == run_id, runs.c.status.in_(sources))
                         .values(**values))
    if moved.rowcount == 0:
        now_status = conn.execute(select(runs.c.status).where(runs.c.id == run_id)).scalar()
        if now_status is not None:
            raise RunTransitionRefused(run_id, now_status, to)


def set_protected(conn: Connection, *, run_id: int, paths: list[str]) -> None:
    """The checkpoint paths the workers' retention must keep (every ingest reply carries
    them)."""
    conn.execute(update(runs).where(runs.c.id == run_id).values(protected=paths))


def agents_off_attempt(conn: Connection, *, run_id: int, attempt: int) -> list[AgentAttemptRow]:
    """The run's members whose reports carry an attempt other than ``attempt`` (read every
    tick inside the write transaction: only those rows, no JSON health columns).  A spare
    runs no attempt: it is never realigned."""
    a = agents.c
    q = (select(a.id, a.node, a.attempt, a.state, a.last_seen_at)
         .where(a.run_id == run_id, a.attempt.is_not(None), a.attempt != attempt,
                a.role == NodeRole.MEMBER)
         .order_by(a.id))
    return [{"id": int(i), "node": n, "attempt": int(at), "state": st, "last_seen_at": t}
            for i, n, at, st, t in conn.execute(q)]


def run_agents(conn: Connection, *, run_id: int) -> list[AgentRow]:
    """The run's agents, their health readings in the shape of ``health`` whatever the row
    holds."""
    q = select(agents).where(agents.c.run_id == run_id).order_by(agents.c.id)
    out = []
    for r in conn.execute(q):
        a = cast(AgentRow, row(r))
        if a["workers"] is not None:
            a["workers"] = worker_stats(a["workers"])
        a["gpus"] = gpu_health(a["gpus"])
        out.append(a)
    return out

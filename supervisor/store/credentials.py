"""Per-agent credentials: the digest of each agent's secret, and who holds a (run, node).
Keyword-only functions taking a ``Connection``; the decisions are
``trainwarden.supervisor.api.deps``'s.

The secret is 256 random bits, so its SHA-256 digest is kept (no KDF: nothing to brute
force), and checking one is a digest comparison (``deps`` caches the digest per agent)."""

from __future__ import annotations

import hashlib
import secrets
from typing import NamedTuple, TypedDict

from sqlalchemy import Connection, select

from trainwarden.agent.core.states import CommandKind, CommandStatus
from trainwarden.supervisor.enums import FINAL_STATUSES, ActionStatus
from trainwarden.supervisor.store._sql import insert
from trainwarden.supervisor.store.tables import (
    actions,
    agent_credentials,
    agents,
    commands,
    runs,
)

TAKEOVER = "takeover"  # the kind of the audited action

SECRET_PREFIX = "twa_"  # so a leaked credential is recognisable (and told from a token)


class NodeHolder(TypedDict):
    """The agent registered for a (run, node), as a re-registration judges it."""

    agent_id: int
    hostname: str
    pid: int | None
    last_seen_at: float
    secret_hash: str | None  # None: revoked by an operator, or registered before credentials
    revoked_hash: str | None  # the credential an operator revoked


def digest(secret: str) -> str:
    return "sha256:" + hashlib.sha256(secret.encode()).hexdigest()


def node_holder(conn: Connection, *, run_id: int, node: str) -> NodeHolder | None:
    q = (select(agents.c.id, agents.c.hostname, agents.c.pid, agents.c.last_seen_at,
                agent_credentials.c.secret_hash, agent_credentials.c.revoked_hash)
         .select_from(agents.outerjoin(agent_credentials,
                                       agent_credentials.c.agent_id == agents.c.id))
         .where(agents.c.run_id == run_id, agents.c.node == node))
    r = conn.execute(q).first()
    if r is None:
        return None
    return {"agent_id": int(r.id), "hostname": r.hostname, "pid": r.pid,
            "last_seen_at": float(r.last_seen_at), "secret_hash": r.secret_hash,
            "revoked_hash": r.revoked_hash}


def issue(conn: Connection, *, agent_id: int, now: float) -> str:
    """A new secret for the agent, replacing (revoking) the one it had; returns the secret,
    which is never stored and cannot be read back.  The replaced one is remembered as
    revoked (an agent presenting it is told it was replaced)."""
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    r = conn.execute(select(agent_credentials.c.secret_hash, agent_credentials.c.revoked_hash)
                     .where(agent_credentials.c.agent_id == agent_id)).first()
    revoked = None if r is None else (r.secret_hash or r.revoked_hash)
    values = {"secret_hash": digest(secret), "revoked_hash": revoked, "issued_at": now}
    ins = insert(conn, agent_credentials).values(agent_id=agent_id, **values)
    conn.execute(ins.on_conflict_do_update(index_elements=["agent_id"], set_=values))
    return secret


class AgentKey(NamedTuple):
    """What the ingest check needs of an agent: its credential's digest (None: revoked) and
    the name of its run (a scoped token writes only for the runs of its scope)."""

    secret_hash: str | None
    run: str


def agent_key(conn: Connection, *, agent_id: int) -> AgentKey | None:
    """The agent's ``AgentKey``; None when there is no such agent."""
    q = (select(agent_credentials.c.secret_hash, runs.c.name)
         .select_from(agents.join(runs, runs.c.id == agents.c.run_id)
                      .outerjoin(agent_credentials,
                                 agent_credentials.c.agent_id == agents.c.id))
         .where(agents.c.id == agent_id))
    r = conn.execute(q).first()
    return None if r is None else AgentKey(r.secret_hash, str(r.name))


def ended_runs_holding_credentials(conn: Connection, *, ended_before: float) -> list[int]:
    """The runs that ended (completed, failed, stopped) at or before ``ended_before`` and
    whose agents still hold a live credential, save those with an agent still leaving: one
    heard from since ``ended_before`` whose stop command it has not finished (it keeps its
    credential to deliver what it spooled; silent, it has left or is lost)."""
    leaving = (select(commands.c.id)
               .select_from(commands.join(agents, agents.c.id == commands.c.agent_id))
               .where(commands.c.run_id == runs.c.id, commands.c.kind == CommandKind.STOP,
                      commands.c.status.in_([CommandStatus.PENDING, CommandStatus.DELIVERED]),
                      agents.c.last_seen_at > ended_before)
               .correlate(runs))
    q = (select(runs.c.id).distinct()
         .select_from(runs.join(agents, agents.c.run_id == runs.c.id)
                      .join(agent_credentials, agent_credentials.c.agent_id == agents.c.id))
         .where(runs.c.status.in_(list(FINAL_STATUSES)), runs.c.updated_at <= ended_before,
                agent_credentials.c.secret_hash.is_not(None), ~leaving.exists())
         .order_by(runs.c.id))
    return [int(r) for r, in conn.execute(q)]


def revoke_run(conn: Connection, *, run_id: int, now: float) -> list[int]:
    """Revoke every credential of the run's agents (a run that has ended: nothing it sends
    is stored any more); returns the agents whose credential was live."""
    live = [int(a) for a, in conn.execute(
        select(agent_credentials.c.agent_id)
        .select_from(agent_credentials.join(agents, agents.c.id == agent_credentials.c.agent_id))
        .where(agents.c.run_id == run_id, agent_credentials.c.secret_hash.is_not(None)))]
    for agent_id in live:
        revoke(conn, agent_id=agent_id, now=now)
    return live


def revoke(conn: Connection, *, agent_id: int, now: float) -> bool:
    """Revoke the agent's credential (an operator's takeover): its ingest is refused, its
    re-registration with it is told it was replaced, and the node's next registration
    claims the node.  False when it held none."""
    r = conn.execute(select(agent_credentials.c.secret_hash, agent_credentials.c.revoked_hash)
                     .where(agent_credentials.c.agent_id == agent_id)).first()
    old = r.secret_hash if r is not None else None
    values = {"secret_hash": None, "revoked_hash": old or (r.revoked_hash if r else None),
              "issued_at": now}
    ins = insert(conn, agent_credentials).values(agent_id=agent_id, **values)
    conn.execute(ins.on_conflict_do_update(index_elements=["agent_id"], set_=values))
    return old is not None


def record_takeover(conn: Connection, *, run_id: int, attempt: int, node: str,
                    holder: NodeHolder, hostname: str, actor: str, now: float) -> int:
    """The audited action of an operator's takeover of a node (done when recorded)."""
    reason = (f"operator takeover of node {node!r}: agent {holder['agent_id']}'s credential "
              f"revoked (it ran on host {holder['hostname']!r}, pid {holder['pid']}"
              + (f"; the new agent runs on {hostname!r}" if hostname else "") + ")")
    return int(conn.execute(actions.insert().values(
        run_id=run_id, kind=TAKEOVER, reason=reason, actor=actor, status=ActionStatus.DONE,
        attempt=attempt, created_at=now, updated_at=now,
        progress={ActionStatus.DONE: now}).returning(actions.c.id)).scalar_one())


def changed_since(conn: Connection, *, since: float) -> dict[int, str | None]:
    """agent id -> its credential's digest (None: revoked), for the credentials issued,
    replaced or revoked at ``since`` or later (what another replica may have changed)."""
    q = (select(agent_credentials.c.agent_id, agent_credentials.c.secret_hash)
         .where(agent_credentials.c.issued_at >= since))
    return {int(r.agent_id): r.secret_hash for r in conn.execute(q)}

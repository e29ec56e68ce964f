"""The per-node health ledger: each node's state (``hosts``), the evidence against it
(``host_evidence``) and every change of its state, audited (``host_actions``).

Nodes are keyed by the agent's node name (``trainwarden agent --node``, the hostname by
default), not by an agent or a run: a node keeps its history across runs, and a re-imaged
node whose new agent registers under the same name keeps it too.  A node without a row is
healthy.

The state changes are conditional updates (``cordon`` never on a cordoned node, ``uncordon``
only a cordoned one, ``preflight_passed`` only on probation), so two writers cannot both
make the same change; a refused change raises ``HostStateError`` and writes nothing.
Keyword-only functions taking a ``Connection``, as the rest of the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypedDict, cast

from sqlalchemy import Connection, and_, func, select, update

from trainwarden.agent.core.states import NodeRole
from trainwarden.supervisor.enums import (
    ACTIVE_STATUSES,
    Actor,
    EvidenceKind,
    HostActionKind,
    HostState,
)
from trainwarden.supervisor.fleet import DOWN_REASON_PREFIX
from trainwarden.supervisor.store import tables
from trainwarden.supervisor.store._sql import insert, json_safe, row
from trainwarden.supervisor.store.health import gpu_health
from trainwarden.supervisor.store.rows import (
    EvidenceRow,
    HostActionRow,
    HostRow,
    HostSummary,
    IncidentRow,
)
from trainwarden.supervisor.store.tables import agents, host_evidence, hosts, incidents, runs

host_actions_table = tables.host_actions  # (``host_actions`` is the reader below)

_HOST_COLUMNS = (hosts.c.node, hosts.c.state, hosts.c.reason, hosts.c.actor, hosts.c.since,
                 hosts.c.updated_at, hosts.c.cleared_at)


class HostStateError(ValueError):
    """The node is not in the state the change needs; nothing was changed."""

    def __init__(self, node: str, state: str, message: str) -> None:
        super().__init__(message)
        self.node, self.state = node, state


# ---------------------------------------------------------------------------------------------
# states


def _ensure(conn: Connection, node: str, now: float) -> None:
    """The node's row, healthy, unless it has one."""
    conn.execute(insert(conn, hosts).values(
        node=node, state=HostState.HEALTHY, reason="", actor="", since=now, updated_at=now,
        cleared_at=None, gpu_counters={}).on_conflict_do_nothing(index_elements=["node"]))


def get_host(conn: Connection, *, node: str) -> HostRow | None:
    r = conn.execute(select(*_HOST_COLUMNS).where(hosts.c.node == node)).first()
    return cast(HostRow, row(r)) if r else None


def host_states(conn: Connection) -> dict[str, HostRow]:
    """Every node with a row, by name (a node without one is healthy)."""
    return {r.node: cast(HostRow, row(r))
            for r in conn.execute(select(*_HOST_COLUMNS).order_by(hosts.c.node))}


def _nodes_in(conn: Connection, state: HostState) -> set[str]:
    return {str(n) for n in conn.execute(select(hosts.c.node).where(hosts.c.state == state))
            .scalars()}


def cordoned_nodes(conn: Connection) -> set[str]:
    """The nodes never to be chosen as members (cordoned; not those on probation)."""
    return _nodes_in(conn, HostState.CORDONED)


def cordon_reasons(conn: Connection) -> dict[str, str]:
    """node -> why it is cordoned, for every cordoned node."""
    return {str(n): str(why) for n, why in conn.execute(
        select(hosts.c.node, hosts.c.reason).where(hosts.c.state == HostState.CORDONED))}


def probation_nodes(conn: Connection) -> set[str]:
    """The nodes an operator uncordoned that have not passed a preflight since."""
    return _nodes_in(conn, HostState.PROBATION)


def _act(conn: Connection, *, node: str, kind: HostActionKind, actor: str, reason: str,
         now: float, run_id: int | None, evidence_ids: Iterable[int]) -> int:
    return int(conn.execute(host_actions_table.insert().values(
        node=node, kind=kind, actor=actor, reason=reason, run_id=run_id,
        evidence_ids=[int(i) for i in evidence_ids], created_at=now,
    ).returning(host_actions_table.c.id)).scalar_one())


def cordon(conn: Connection, *, node: str, reason: str, actor: str, now: float,
           run_id: int | None = None, evidence_ids: Sequence[int] = ()) -> int:
    """Cordon ``node`` (healthy or on probation; a node never seen gets its row); returns the
    audited host action's id.  ``HostStateError`` when it is cordoned already."""
    _ensure(conn, node, now)
    changed = conn.execute(
        update(hosts).where(hosts.c.node == node, hosts.c.state != HostState.CORDONED)
        .values(state=HostState.CORDONED, reason=reason, actor=actor, since=now,
                updated_at=now)).rowcount
    if not changed:
        h = get_host(conn, node=node)
        assert h is not None
        raise HostStateError(node, h["state"], f"node {node!r} is cordoned already (since "
                             f"{h['since']:.0f}, by {h['actor']}: {h['reason']})")
    return _act(conn, node=node, kind=HostActionKind.CORDON, actor=actor, reason=reason,
                now=now, run_id=run_id, evidence_ids=evidence_ids)


def uncordon(conn: Connection, *, node: str, reason: str, actor: str, now: float) -> int:
    """A cordoned node goes on probation (healthy again once it passes a preflight); evidence
    from before now no longer counts against it.  Its cordons in single runs are lifted too.
    Returns the host action's id; ``HostStateError`` when the node is cordoned nowhere."""
    lifted = conn.execute(update(agents).where(agents.c.node == node, agents.c.cordon.is_not(None))
                          .values(cordon=None)).rowcount
    changed = conn.execute(
        update(hosts).where(hosts.c.node == node, hosts.c.state == HostState.CORDONED)
        .values(state=HostState.PROBATION, reason=reason, actor=actor, since=now,
                updated_at=now, cleared_at=now)).rowcount
    if not changed and not lifted:
        h = get_host(conn, node=node)
        state = h["state"] if h is not None else HostState.HEALTHY
        raise HostStateError(node, state, f"node {node!r} is not cordoned (it is {state}): "
                             "nothing to uncordon")
    return _act(conn, node=node, kind=HostActionKind.UNCORDON, actor=actor, reason=reason,
                now=now, run_id=None, evidence_ids=())


def preflight_passed(conn: Connection, *, node: str, now: float, run_id: int | None,
                     reason: str = "", evidence_ids: Sequence[int] = ()) -> bool:
    """A node on probation passed a preflight: healthy again, audited with the policy as its
    actor.  Whether it changed (False: the node was not on probation)."""
    why = reason or "passed a preflight on probation"
    changed = conn.execute(
        update(hosts).where(hosts.c.node == node, hosts.c.state == HostState.PROBATION)
        .values(state=HostState.HEALTHY, reason=why, actor=Actor.POLICY, since=now,
                updated_at=now)).rowcount
    if changed:
        _act(conn, node=node, kind=HostActionKind.PROBATION_PASSED, actor=Actor.POLICY,
             reason=why, now=now, run_id=run_id, evidence_ids=evidence_ids)
    return bool(changed)


def host_actions(conn: Connection, node: str | None = None, *, limit: int = 1000
                 ) -> list[HostActionRow]:
    """The audited changes, newest first (of one node, or of all)."""
    q = select(host_actions_table)
    if node is not None:
        q = q.where(host_actions_table.c.node == node)
    q = q.order_by(host_actions_table.c.id.desc()).limit(limit)
    return [cast(HostActionRow, row(r)) for r in conn.execute(q)]


# ---------------------------------------------------------------------------------------------
# evidence


def record_evidence_once(conn: Connection, *, node: str, kind: EvidenceKind, run_id: int | None,
                         attempt: int | None, t: float, detail: Mapping[str, Any],
                         source: str | None, trusted: bool = True) -> int | None:
    """Record one piece of evidence against ``node`` (its host row made healthy if it has
    none); the new row's id, or None when evidence from ``source`` was recorded for the node
    already (a source read again on a later tick, or by the next leader).  ``trusted``
    False: from a source not trusted for the host; it counts in its run only (no host row)."""
    if trusted:
        _ensure(conn, node, t)
    stmt = insert(conn, host_evidence).values(
        node=node, kind=kind, run_id=run_id, attempt=attempt, t=t,
        detail=json_safe(dict(detail)), source=source, trusted=trusted)
    if source is not None:
        stmt = stmt.on_conflict_do_nothing(index_elements=["node", "source"])
    new = conn.execute(stmt.returning(host_evidence.c.id)).scalar()
    return None if new is None else int(new)


def record_evidence(conn: Connection, *, node: str, kind: EvidenceKind, run_id: int | None,
                    attempt: int | None, t: float, detail: Mapping[str, Any],
                    source: str | None = None) -> int:
    """Record evidence against ``node``; its id (the one recorded before for ``source``,
    when there is one)."""
    new = record_evidence_once(conn, node=node, kind=kind, run_id=run_id, attempt=attempt,
                               t=t, detail=detail, source=source)
    if new is not None:
        return new
    return int(conn.execute(select(host_evidence.c.id).where(
        host_evidence.c.node == node, host_evidence.c.source == source)).scalar_one())


def evidence(conn: Connection, *, node: str, since: float | None = None, limit: int = 1000,
             run_id: int | None = None) -> list[EvidenceRow]:
    """The node's evidence at or after ``since`` (all of it: None), oldest first; the newest
    ``limit`` when there is more.  The shared ledger's (from sources trusted for the host);
    with ``run_id``, the evidence recorded in that run instead, trusted or not."""
    q = select(host_evidence).where(host_evidence.c.node == node)
    q = (q.where(host_evidence.c.trusted.is_(True)) if run_id is None
         else q.where(host_evidence.c.run_id == run_id))
    if since is not None:
        q = q.where(host_evidence.c.t >= since)
    q = q.order_by(host_evidence.c.t.desc(), host_evidence.c.id.desc()).limit(limit)
    return [cast(EvidenceRow, row(r)) for r in reversed(list(conn.execute(q)))]


def healthy(node: str, *, since: float) -> HostRow:
    """The state of a node without a row: healthy, since ``since``."""
    return HostRow(node=node, state=HostState.HEALTHY, reason="", actor="", since=since,
                   updated_at=since, cleared_at=None)


def first_registered(conn: Connection, *, node: str) -> float | None:
    """When an agent of any run first registered ``node`` (None: none ever did)."""
    v = conn.execute(select(func.min(agents.c.registered_at))
                     .where(agents.c.node == node)).scalar()
    return None if v is None else float(v)


def host_summaries(conn: Connection, *, since: float) -> list[HostSummary]:
    """Every known node (a host row, or an agent of any run registered under its name), by
    name: its state (healthy without a row, since its first agent registered), and its
    evidence since ``since`` (how many pieces, the newest)."""
    states = host_states(conn)
    first_seen: dict[str, float] = dict(conn.execute(
        select(agents.c.node, func.min(agents.c.registered_at)).group_by(agents.c.node)).all())
    against = and_(host_evidence.c.kind != EvidenceKind.PREFLIGHT_PASSED,
                   host_evidence.c.trusted.is_(True))
    counts: dict[str, int] = dict(conn.execute(
        select(host_evidence.c.node, func.count())
        .where(host_evidence.c.t >= since, against).group_by(host_evidence.c.node)).all())
    newest_ids = (select(func.max(host_evidence.c.id)).where(against)
                  .group_by(host_evidence.c.node).scalar_subquery())
    latest = {r.node: cast(EvidenceRow, row(r)) for r in conn.execute(
        select(host_evidence).where(host_evidence.c.id.in_(newest_ids)))}
    out: list[HostSummary] = []
    for node in sorted(states.keys() | first_seen.keys()):
        h = states.get(node) or healthy(node, since=float(first_seen[node]))
        out.append(HostSummary(**h, evidence_count=int(counts.get(node, 0)),
                               latest_evidence=latest.get(node)))
    return out


# ---------------------------------------------------------------------------------------------
# what the evaluator reads the evidence from


def incidents_touched(conn: Connection, *, since: float, kinds: Sequence[str]
                      ) -> list[IncidentRow]:
    """Incidents of ``kinds`` opened or updated at or after ``since`` (the evaluator stamps
    ``updated_at`` whenever it writes one: opened, stacks attached, a straggler's episode
    moved on), oldest first."""
    q = (select(incidents).where(incidents.c.kind.in_(list(kinds)),
                                 func.coalesce(incidents.c.updated_at, incidents.c.opened_at)
                                 >= since)
         .order_by(incidents.c.id))
    return [cast(IncidentRow, row(r)) for r in conn.execute(q)]


class GpuReading(TypedDict):
    """A member agent's newest GPU reading, with what its counters are compared against."""

    agent_id: int
    node: str
    run_id: int
    attempt: int | None
    gpus: dict[str, Any]
    trusted: bool  # the agent is trusted for its host (else its counters are its own)
    counters: dict[str, Any]  # the untrusted agent's counters last seen ({} when trusted)


def gpu_readings(conn: Connection) -> list[GpuReading]:
    """The GPU readings of the members of active runs, oldest heartbeat first (a spare's or
    a replaced node's readings are not evidence)."""
    q = (select(agents.c.id, agents.c.node, agents.c.run_id, agents.c.attempt, agents.c.gpus,
                agents.c.host_trusted, agents.c.gpu_counters)
         .join(runs, runs.c.id == agents.c.run_id)
         .where(runs.c.status.in_(list(ACTIVE_STATUSES)), agents.c.role == NodeRole.MEMBER)
         .order_by(agents.c.last_seen_at, agents.c.id))
    out: list[GpuReading] = []
    for r in conn.execute(q):
        gpus = gpu_health(r.gpus)  # (the shape every reader expects, whatever is stored)
        if gpus is not None:
            out.append(GpuReading(agent_id=int(r.id), node=str(r.node), run_id=int(r.run_id),
                                  attempt=r.attempt, gpus=gpus, trusted=bool(r.host_trusted),
                                  counters=dict(r.gpu_counters or {})))
    return out


def set_agent_gpu_counters(conn: Connection, *, agent_id: int, counters: Mapping[str, Any]
                           ) -> None:
    """The counters last seen from an agent not trusted for its host."""
    conn.execute(update(agents).where(agents.c.id == agent_id)
                 .values(gpu_counters=json_safe(dict(counters))))


def node_trust(conn: Connection, *, run_id: int) -> dict[str, bool]:
    """node -> whether the run's agent on it is trusted for its host."""
    return {str(n): bool(t) for n, t in conn.execute(
        select(agents.c.node, agents.c.host_trusted).where(agents.c.run_id == run_id))}


# ---------------------------------------------------------------------------------------------
# cordons in one run only


def cordon_in_run(conn: Connection, *, run_id: int, node: str, reason: str, actor: str,
                  now: float, evidence_ids: Sequence[int] = ()) -> int | None:
    """Cordon ``node`` in ``run_id`` only (its agent there; no other run, and not the shared
    ledger); the audited host action's id, or None when it is cordoned there already (or
    the run has no agent on it)."""
    changed = conn.execute(update(agents).where(agents.c.run_id == run_id,
                                                agents.c.node == node,
                                                agents.c.cordon.is_(None))
                           .values(cordon=reason)).rowcount
    if not changed:
        return None
    return _act(conn, node=node, kind=HostActionKind.RUN_CORDON, actor=actor, reason=reason,
                now=now, run_id=run_id, evidence_ids=evidence_ids)


def run_cordons(conn: Connection, *, run_id: int) -> dict[str, str]:
    """node -> why it is cordoned in this run only."""
    return {str(n): str(why) for n, why in conn.execute(
        select(agents.c.node, agents.c.cordon).where(agents.c.run_id == run_id,
                                                     agents.c.cordon.is_not(None)))}


def gpu_counters(conn: Connection) -> dict[str, dict[str, Any]]:
    """node -> the NVML counters last seen on it (``Host.gpu_counters``)."""
    return {str(r.node): dict(r.gpu_counters or {})
            for r in conn.execute(select(hosts.c.node, hosts.c.gpu_counters))}


def set_gpu_counters(conn: Connection, *, node: str, counters: Mapping[str, Any], now: float
                     ) -> None:
    _ensure(conn, node, now)
    conn.execute(update(hosts).where(hosts.c.node == node)
                 .values(gpu_counters=json_safe(dict(counters))))


def record_host_action(conn: Connection, *, node: str, kind: HostActionKind, actor: str,
                       reason: str, now: float) -> int:
    """An audited action about ``node`` that changes no state (a scheduler's command and its
    output)."""
    return _act(conn, node=node, kind=kind, actor=actor, reason=reason, now=now, run_id=None,
                evidence_ids=())



def fleet_down(conn: Connection) -> dict[str, str]:
    """node -> reason, of the nodes the fleet's scheduler says are down (cordoned by the
    fleet for it: ``policy.fleet_decisions``)."""
    rows = conn.execute(select(hosts.c.node, hosts.c.reason).where(
        hosts.c.state == HostState.CORDONED, hosts.c.actor == Actor.FLEET,
        hosts.c.reason.startswith(DOWN_REASON_PREFIX)))
    return {str(r.node): str(r.reason) for r in rows}

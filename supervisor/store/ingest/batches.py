"""A group of batches stored in the caller's one transaction: the agents' heads, the
checkpoint paths checked, each (agent_id, seq) claimed once, the rows written, the replies
(``ingest_batches``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    Connection,
    and_,
    bindparam,
    func,
    or_,
    select,
)

from trainwarden.agent.core.states import NodeRole
from trainwarden.supervisor.contract import checkpoint_paths, wire
from trainwarden.supervisor.store.ingest.clock import DEFAULT, IngestConfig
from trainwarden.supervisor.store.ingest.collect import Collected, collect, flush
from trainwarden.supervisor.store.ingest.commands import pending_commands
from trainwarden.supervisor.store.ingest.statements import HotSQL, hot_sql
from trainwarden.supervisor.store.tables import (
    agents,
    ingested_batches,
    runs,
)


@dataclass
class IngestResult:
    run_id: int
    attempt: int
    duplicate: bool
    commands: list[dict[str, Any]]
    protect: list[str] = field(default_factory=list)  # checkpoint paths to keep
    role: NodeRole = NodeRole.MEMBER  # what the agent is in the run now
    epoch: int = 0  # the run's membership epoch


class UnknownAgent(LookupError):
    pass


class CheckpointRefused(ValueError):
    """A batch reporting a checkpoint outside the agent's registered roots: nothing of it is
    stored.  ``errors``: one ``{"loc", "msg", "type"}`` per refused path (``loc`` within the
    batch, as a 422 names it)."""

    def __init__(self, agent_id: int, errors: list[dict[str, Any]]) -> None:
        super().__init__("; ".join(e["msg"] for e in errors))
        self.agent_id = agent_id
        self.errors = errors


class SeqConflict(ValueError):
    """The batch's (agent_id, seq) was stored before with different content: nothing of it is
    stored.  ``next_seq``: the agent's first sequence number not stored yet."""

    def __init__(self, agent_id: int, seq: int, next_seq: int) -> None:
        super().__init__(f"seq {seq} of agent {agent_id} was already used for different "
                         f"content: nothing stored (the agent's next free seq is {next_seq})")
        self.agent_id, self.seq, self.next_seq = agent_id, seq, next_seq


def ingest_batch(conn: Connection, *, batch: wire.IngestBatch, now: float,
                 cfg: IngestConfig = DEFAULT) -> IngestResult:
    """Store one batch in the caller's transaction (see ``ingest_batches``).

    Raises ``UnknownAgent`` when the agent id was never registered, ``CheckpointRefused``
    when it reports a checkpoint outside its registered roots, ``SeqConflict`` when its
    (agent_id, seq) was stored before with different content."""
    res = ingest_batches(conn, batches=[batch], now=now, cfg=cfg)[0]
    if isinstance(res, UnknownAgent | CheckpointRefused | SeqConflict):
        raise res
    return res


Outcome = IngestResult | UnknownAgent | CheckpointRefused | SeqConflict


def ingest_batches(
    conn: Connection, *, batches: Sequence[wire.IngestBatch], now: float,
    cfg: IngestConfig = DEFAULT,
) -> list[Outcome]:
    """Store a group of batches in the caller's ONE transaction; results in input order.

    A replayed (agent_id, seq), stored before or earlier in the same group, stores nothing and
    is answered as a duplicate when its content is the same (``IngestBatch.content_digest``),
    with ``SeqConflict`` when it differs.  A batch of an unregistered agent gets
    ``UnknownAgent`` and stores nothing.  A batch reporting a checkpoint path outside the
    agent's registered roots (``trainwarden.supervisor.contract.checkpoint_paths``) gets
    ``CheckpointRefused`` and
    stores nothing (a replay of a batch stored before is still a duplicate); the paths of the
    others are stored normalised.  Rows of all batches go in one multi-row statement per
    table, and the per-step aggregates are merged across the group first: the cost per batch
    falls as the load rises (the ingest writer groups whatever arrived while the last group
    was written).

    Agent timestamps are checked against ``now`` (``IngestConfig``): one that is not finite,
    or further off than the allowed skew, is stored as ``now`` and counted in the agent's
    ``clock_skew`` event.
    """
    hot = hot_sql(conn)
    ids = sorted({b.agent_id for b in batches})
    # (the driver's connection, checked out for this transaction: never None here)
    cur = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
    try:
        return _ingest_group(conn, hot, cur, batches, ids, now, cfg)
    finally:
        cur.close()


def _ingest_group(conn: Connection, hot: HotSQL, cur: Any,
                  batches: Sequence[wire.IngestBatch], ids: list[int], now: float,
                  cfg: IngestConfig) -> list[Outcome]:
    # agent id -> (run id, the run's attempt, its protected checkpoints, the agent's role,
    # the run's membership epoch)
    heads: dict[int, tuple[int, int, list[str], NodeRole, int]]
    if len(ids) == 1:  # the common case on SQLite: the raw single-agent statement
        r = hot.fetchone(cur, "head", {"agent_id": ids[0]})
        heads = {ids[0]: (int(r[0]), int(r[1]), json_list(r[2]), NodeRole(r[3]), int(r[4]))
                 } if r else {}
    else:
        heads = {int(r[0]): (int(r[1]), int(r[2]), json_list(r[3]), NodeRole(r[4]), int(r[5]))
                 for r in conn.execute(_HEADS, {"ids": ids})}
    refused, paths = _checkpoint_paths(conn, batches, heads)
    # Claim each (agent_id, seq) once; RETURNING, not rowcount, says which ones were new.
    wanted: dict[tuple[int, int], dict[str, Any]] = {}
    digests: list[str | None] = []
    for i, b in enumerate(batches):
        d = b.content_digest() if b.agent_id in heads else None
        digests.append(d)
        if b.agent_id in heads and i not in refused and (b.agent_id, b.seq) not in wanted:
            wanted[(b.agent_id, b.seq)] = {"agent_id": b.agent_id, "seq": b.seq,
                                           "received_at": now, "items": len(b.items),
                                           "digest": d}
    claimed = {(int(r[0]), int(r[1]))
               for r in hot.insert_rows(cur, "claim", list(wanted.values()), fetch=True)}
    # The content already stored under each replayed key (what this group claimed counts).
    known = {k: w["digest"] for k, w in wanted.items() if k in claimed}
    replayed = [k for k in wanted if k not in claimed]
    if replayed:
        known.update(_stored_digests(conn, keys=replayed))
    acc = Collected()
    duplicate: list[bool] = []
    conflicts: dict[int, SeqConflict] = {}
    for i, b in enumerate(batches):
        key = (b.agent_id, b.seq)
        new = key in claimed and i not in refused
        claimed.discard(key)  # a second copy in this group is a replay
        duplicate.append(not new)
        if new:
            collect(acc, b, run_id=heads[b.agent_id][0], now=now, cfg=cfg,
                     paths=paths.get(i, []), member=heads[b.agent_id][3] == NodeRole.MEMBER)
        elif (b.agent_id in heads and i not in refused
              and known.get(key) not in (None, digests[i])):
            conflicts[i] = SeqConflict(b.agent_id, b.seq, _next_seq(conn, agent_id=b.agent_id))
    aggs = flush(conn, hot, cur, acc, now=now)
    # After this group's acknowledgements, so an acknowledged command is not re-sent.
    # (Not for an agent whose batches were all refused: its reply carries none.)
    answered = sorted({b.agent_id for i, b in enumerate(batches)
                       if b.agent_id in heads and i not in conflicts and i not in refused})
    pending = pending_commands(conn, hot, cur, answered, now)
    if aggs:
        # Last, right before the commit: every agent of a run updates the same step row,
        # and Postgres holds that row lock until the commit.  Sorted keys: concurrent
        # writers lock rows in the same order (no deadlock).
        hot.insert_rows(cur, "aggregates", aggs)
    out: list[Outcome] = []
    for i, (b, dup) in enumerate(zip(batches, duplicate, strict=True)):
        if b.agent_id not in heads:
            out.append(UnknownAgent(b.agent_id))
            continue
        if i in refused:
            out.append(refused[i])
            continue
        if i in conflicts:
            out.append(conflicts[i])
            continue
        run_id, attempt, protect, role, epoch = heads[b.agent_id]
        out.append(IngestResult(run_id=run_id, attempt=attempt, duplicate=dup,
                                commands=pending.get(b.agent_id, []), protect=protect,
                                role=role, epoch=epoch))
    return out


def _checkpoint_paths(conn: Connection, batches: Sequence[wire.IngestBatch],
                      heads: dict[int, Any]
                      ) -> tuple[dict[int, CheckpointRefused], dict[int, list[str]]]:
    """Batch index -> its refusal, and batch index -> its checkpoint paths normalised (in
    item order), for the batches of known agents that report checkpoints.  A refused batch
    that was stored before (a replay, from before the agent's roots changed) is left to the
    duplicate check instead."""
    wanted = sorted({b.agent_id for b in batches if b.agent_id in heads
                     and any(isinstance(it, wire.CheckpointItem) for it in b.items)})
    if not wanted:  # the common case: no extra statement
        return {}, {}
    roots = {int(r[0]): [x for x in (r[1] or []) if isinstance(x, str)]
             for r in conn.execute(select(agents.c.id, agents.c.checkpoint_roots)
                                   .where(agents.c.id.in_(wanted)))}
    refused: dict[int, CheckpointRefused] = {}
    paths: dict[int, list[str]] = {}
    for i, b in enumerate(batches):
        if b.agent_id not in roots:
            continue
        ok: list[str] = []
        errors: list[dict[str, Any]] = []
        for j, it in enumerate(b.items):
            if not isinstance(it, wire.CheckpointItem):
                continue
            try:
                ok.append(checkpoint_paths.resolve(it.path, roots[b.agent_id]))
            except checkpoint_paths.OutsideRoots as e:
                errors.append({"loc": ["items", str(j), "path"], "msg": str(e),
                               "type": "checkpoint_outside_roots"})
        if not errors:
            paths[i] = ok
        elif conn.execute(select(ingested_batches.c.seq).where(
                ingested_batches.c.agent_id == b.agent_id,
                ingested_batches.c.seq == b.seq)).first() is None:
            refused[i] = CheckpointRefused(b.agent_id, errors)
    return refused, paths


def _stored_digests(conn: Connection, *, keys: list[tuple[int, int]]
                    ) -> dict[tuple[int, int], str | None]:
    """The content digests stored under replayed (agent_id, seq) keys (the rare path)."""
    ib = ingested_batches.c
    q = select(ib.agent_id, ib.seq, ib.digest).where(
        or_(*(and_(ib.agent_id == a, ib.seq == s) for a, s in keys)))
    return {(int(r[0]), int(r[1])): r[2] for r in conn.execute(q)}


def _next_seq(conn: Connection, *, agent_id: int) -> int:
    top = conn.execute(select(func.max(ingested_batches.c.seq))
                       .where(ingested_batches.c.agent_id == agent_id)).scalar_one()
    return 0 if top is None else int(top) + 1


def json_list(raw: Any) -> list[str]:
    """A JSON list column read on the raw cursor (text on SQLite, decoded on Postgres)."""
    if isinstance(raw, str | bytes):
        raw = json.loads(raw)
    return [str(x) for x in raw] if isinstance(raw, list) else []


_HEADS = (
    select(agents.c.id, agents.c.run_id, runs.c.attempt, runs.c.protected, agents.c.role,
           runs.c.epoch)
    .join(runs, runs.c.id == agents.c.run_id)
    .where(agents.c.id.in_(bindparam("ids", expanding=True)))
)

"""Agent-facing routes: register and ingest."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request, Response, status
from pydantic import ValidationError

from trainwarden.supervisor.api.deps import (
    DB,
    AgentAuth,
    ClockDep,
    Credentials,
    OperatorAuth,
    Principal,
    Settings,
    judge_registration,
    presented_credential,
)
from trainwarden.supervisor.api.errors import (
    ERROR_RESPONSES,
    SafeJSONResponse,
    SeqConflictBody,
    validation_error_response,
)
from trainwarden.supervisor.api.responses import TakeoverDone, documented
from trainwarden.supervisor.contract import checkpoint_paths, wire
from trainwarden.supervisor.contract.limits import NodeName, RunName
from trainwarden.supervisor.ingest.writer import IngestWriter
from trainwarden.supervisor.store import credentials, membership, registry
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.ingest import CheckpointRefused, SeqConflict, UnknownAgent

log = logging.getLogger("trainwarden.ingest")

router = APIRouter(tags=["agents"], responses=ERROR_RESPONSES)


@router.post("/agents/register", response_model=wire.RegisterReply)
def register(
    req: wire.RegisterRequest, request: Request, db: DB, clock: ClockDep, settings: Settings,
    creds: Credentials, auth: AgentAuth,
) -> wire.RegisterReply:
    """Register a node agent for a run (the run is created on first use, with a new
    ``run_uuid``).  The reply's ``credential`` is the agent's secret: every ingest must send
    it (header ``X-Trainwarden-Agent-Credential``).  Registering again with the same run and
    node returns the same ``agent_id`` and the next sequence number; presenting the
    credential in that header keeps it.  A node whose agent is alive (heard from within the
    node-lost deadline) is refused with 409 unless the credential is presented or an
    operator takes over (``takeover: true`` with the operator token: the old credential is
    revoked, an audited action).  A run that has ended (completed, failed, stopped) is
    refused with 409 and a message that says what to do: it is never silently reopened.
    The run's settings (its command's shape, the world it declares with torchrun's
    ``--nnodes``, at most 65,536, and ``min_nodes``) are its first member's: a registration
    that disagrees is refused with 409 naming the field and both values.  A new node beyond
    the declared world, or one registering with ``spare: true``, is a spare: it runs nothing
    until the policy gives it a lost or cordoned member's node rank (the reply's
    ``membership``), and what it sends is recorded, never acted on; a run a spare registers
    first is ``pending`` until its first member registers.  A torchrun command the agent
    cannot rewrite for the supervisor's membership is refused with 422 and the fix.  An agent
    registered with a token scoped to no run is trusted for its host's evidence (the shared
    health ledger); a run-scoped one's counts in its run only."""
    outside = checkpoint_paths.outside_allowed(
        req.checkpoint_roots, checkpoint_paths.allowed_prefixes(
            settings.auth.checkpoint_roots_allowed))
    if outside is not None:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"checkpoint root {outside!r} is outside the directories this supervisor allows "
            f"(auth.checkpoint_roots_allowed: {settings.auth.checkpoint_roots_allowed}): save "
            "checkpoints in one of them")
    now = clock()
    presented = presented_credential(request)
    judge = judge_registration(run=req.run, node=req.node, presented=presented,
                               takeover=req.takeover, principal=auth, now=now,
                               live_s=settings.node_lost.deadline_s)
    try:
        with db.write() as conn:
            r = registry.register_agent(conn, req=req, now=now, judge=judge,
                                        peer=request.client.host if request.client else "",
                                        host_trusted=auth.trusted_for_hosts)
            if r["claim"] == "takeover" and r["holder"] is not None:
                credentials.record_takeover(conn, run_id=r["run_id"], attempt=r["attempt"],
                                            node=req.node, holder=r["holder"],
                                            hostname=req.hostname, actor=auth.actor, now=now)
    except registry.RunFinished as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from None
    except registry.CommandRefused as e:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, str(e)) from None
    except membership.SettingsConflict as e:
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"run {req.run!r}, node {req.node!r}: {e}") from None
    secret = r["credential"] or presented or ""
    if r["credential"] is not None:
        creds.remember(r["agent_id"], credentials.digest(secret), req.run)
    return wire.RegisterReply(
        agent_id=r["agent_id"], run_id=r["run_id"], run_uuid=r["run_uuid"],
        attempt=r["attempt"], next_seq=r["next_seq"], credential=secret,
        heartbeat_interval_s=settings.server.heartbeat_interval_s,
        membership=wire.MembershipOut(**r["membership"]),
        node_lost_s=settings.node_lost.deadline_s)


@router.post("/runs/{run}/nodes/{node:path}/takeover", response_model=None,
             responses=documented(TakeoverDone))
def takeover(run: RunName, node: NodeName, db: DB, clock: ClockDep, creds: Credentials,
             auth: OperatorAuth) -> dict[str, Any]:
    """Revoke the credential of the agent holding ``node`` of ``run`` (operator; an audited
    action): its batches are refused from now on, its re-registration is told it was
    replaced, and the node's next registration (the new agent's) claims the node."""
    now = clock()
    with db.write() as conn:
        r = registry.get_run_by_name(conn, name=run)
        holder = None if r is None else credentials.node_holder(conn, run_id=r["id"], node=node)
        if r is None or holder is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND,
                                f"run {run!r} has no agent on node {node!r}")
        credentials.revoke(conn, agent_id=holder["agent_id"], now=now)
        action_id = credentials.record_takeover(
            conn, run_id=r["id"], attempt=r["attempt"], node=node, holder=holder, hostname="",
            actor=auth.actor, now=now)
    creds.remember(holder["agent_id"], None)
    return {"run": run, "node": node, "agent_id": holder["agent_id"], "action_id": action_id}


INGEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestBatch"}}},
    }
}


@router.post("/ingest", response_model=wire.IngestReply, openapi_extra=INGEST_BODY,
             responses={409: {"model": SeqConflictBody,
                              "description": "The seq was already used for different content"}})
async def ingest(request: Request, auth: AgentAuth) -> Response:
    """Store one batch of the agent whose credential comes in the
    ``X-Trainwarden-Agent-Credential`` header (another agent's, a revoked or a missing one:
    403, nothing stored; the ``X-Trainwarden-Credential: invalid`` header says to register
    again).  Idempotent by ``agent_id`` + ``seq``: a replay of the same content stores nothing
    and is answered ``duplicate: true``; the same seq with different content is refused with
    409, stores nothing, and is logged.  A checkpoint path outside the agent's registered
    roots is 422 naming the path and the roots, and nothing of the batch is stored.  The reply
    carries the agent's unacknowledged commands and the checkpoints its workers' retention
    must keep (``protect``).

    The hot path, kept lean on purpose: it is answered ahead of the middleware stack
    (``trainwarden.supervisor.server.ingest_path``), the body is validated straight from its
    bytes by pydantic (NaN/Infinity tokens accepted), batches are stored by the ingest writer's
    group commit (``trainwarden.supervisor.ingest.writer``), and the reply is rendered here."""
    return await store_batch(request, await request.body(), auth)


async def store_batch(request: Request, body: bytes, principal: Principal) -> Response:
    """The ingest route's work once its token is checked: validate ``body``, check the
    agent's credential, store the batch and render the reply.
    ``trainwarden.supervisor.server.ingest_path``
    calls it ahead of the middleware stack; the route above is the same for a caller that
    reaches the router.  ``principal``: the token's (its scope must cover the agent's run).
    Raises ``HTTPException`` (403, 404) as a route does."""
    state = request.app.state
    db: Database = state.db
    try:
        batch = wire.IngestBatch.model_validate_json(body)
    except ValidationError as e:
        return validation_error_response(e.errors(), prefix=("body",))
    state.agent_credentials.check(db, batch.agent_id, presented_credential(request), principal)
    writer: IngestWriter = state.ingest_writer
    try:
        res = await writer.submit(batch)
    except CheckpointRefused as e:
        # Nothing of the batch is stored; the agent sets it aside (a 4xx is final).
        return validation_error_response(e.errors, prefix=("body",))
    except UnknownAgent:
        raise HTTPException(
            status.HTTP_404_NOT_FOUND,
            f"unknown agent_id {batch.agent_id}: register first (POST /api/v1/agents/register)",
        ) from None
    except SeqConflict as e:
        log.warning("refused batch: %s", e)
        return SafeJSONResponse(status_code=status.HTTP_409_CONFLICT,
                                content={"detail": str(e), "next_seq": e.next_seq})
    now = state.clock()
    # How late a batch is stored (from when the agent made it: its wait in the agent's spool,
    # the network, our queue and the store) tells an overloaded supervisor from lost nodes.
    state.delivery.observe(batch.agent_id, batch.made_at(), now)
    reply = {"seq": batch.seq, "duplicate": res.duplicate, "attempt": res.attempt,
             "commands": res.commands, "protect": res.protect, "role": res.role,
             "epoch": res.epoch}
    every = state.evaluator.advised_batch_interval()
    if every is not None:  # backpressure: fewer, larger batches while it is behind
        reply["batch_interval_s"] = every
    return Response(json.dumps(reply, separators=(",", ":")), media_type="application/json")

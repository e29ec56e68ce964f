"""Agent-facing routes: register and ingest."""

from __future__ import annotations

import json
import logging

from fastapi import APIRouter, HTTPException, Request, Response, status
from pydantic import ValidationError

from supervisor import wire
from supervisor.api.deps import DB, AgentAuth, ClockDep, Settings, Writer
from supervisor.api.errors import (
    ERROR_RESPONSES,
    SafeJSONResponse,
    SeqConflictBody,
    validation_error_response,
)
from supervisor.store import registry
from supervisor.store.db import Database
from supervisor.store.ingest import (
    CheckpointRefused,
    IngestConfig,
    IngestResult,
    SeqConflict,
    UnknownAgent,
    ingest_batch,
)

log = logging.getLogger("trainwarden.ingest")

router = APIRouter(tags=["agents"], responses=ERROR_RESPONSES)


@router.post("/agents/register", response_model=wire.RegisterReply)
def register(
    req: wire.RegisterRequest, db: DB, clock: ClockDep, settings: Settings, _auth: AgentAuth
) -> wire.RegisterReply:
    """Register a node agent for a run (the run is created on first use, with a new
    ``run_uuid``).  Registering again with the same run and node returns the same ``agent_id``
    and the next sequence number.  A run that has ended (completed, failed, stopped) is
    refused with 409 and a message that says what to do: it is never silently reopened."""
    try:
        with db.write() as conn:
            r = registry.register_agent(conn, req=req, now=clock())
    except registry.RunFinished as e:
        raise HTTPException(status.HTTP_409_CONFLICT, str(e)) from None
    return wire.RegisterReply(heartbeat_interval_s=settings.server.heartbeat_interval_s, **r)


INGEST_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestBatch"}}},
    }
}


def _ingest_inline(db: Database, batch: wire.IngestBatch, now: float, cfg: IngestConfig
                   ) -> IngestResult:
    with db.write() as conn:
        return ingest_batch(conn, batch=batch, now=now, cfg=cfg)


@router.post("/ingest", response_model=wire.IngestReply, openapi_extra=INGEST_BODY,
             responses={409: {"model": SeqConflictBody,
                              "description": "The seq was already used for different content"}})
async def ingest(request: Request, db: DB, clock: ClockDep, writer: Writer, _auth: AgentAuth
                 ) -> Response:
    """Store one batch (idempotent by ``agent_id`` + ``seq``: a replay of the same content
    stores nothing and is answered ``duplicate: true``; the same seq with different content is
    refused with 409, stores nothing, and is logged).  A checkpoint path outside the agent's
    registered roots is 422 naming the path and the roots, and nothing of the batch is
    stored.  The reply carries the agent's unacknowledged commands and the checkpoints its
    workers' retention must keep (``protect``).

    The hot path, kept lean on purpose: the body is validated straight from its bytes by
    pydantic (NaN/Infinity tokens accepted), the store work runs inline (SQLite) or in the
    ingest writer's group commit (Postgres, see ``supervisor.ingest``), and the reply is
    rendered here; FastAPI's body parameter and response model would each add per-request
    work."""
    try:
        batch = wire.IngestBatch.model_validate_json(await request.body())
    except ValidationError as e:
        return validation_error_response(e.errors(), prefix=("body",))

    try:
        if db.is_sqlite:
            # SQLite: inline on the event loop, one transaction per batch.  Its writes are
            # CPU-bound and serialised, and a thread hop per request (or per group) measured
            # slower: the GIL hand-offs cost more than the grouping saves.
            res = _ingest_inline(db, batch, clock(), writer.cfg)
        else:
            # Postgres: group commit through the ingest writer thread.
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
    reply = {"seq": batch.seq, "duplicate": res.duplicate, "attempt": res.attempt,
             "commands": res.commands, "protect": res.protect}
    return Response(json.dumps(reply, separators=(",", ":")), media_type="application/json")

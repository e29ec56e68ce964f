"""FastAPI dependencies: the store, the clock, the settings, the straggler detector's
configuration, and the one token check.

Tests override ``get_db``/``get_clock`` through ``app.dependency_overrides``.  The
dependencies are ``async`` (they do no I/O) so FastAPI does not hop to a thread for each.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, HTTPException, Request, status

from supervisor.config import AuthConfig, SupervisorSettings
from supervisor.detect.straggler import StragglerConfig
from supervisor.evaluator import Clock
from supervisor.ingest import IngestWriter
from supervisor.store.db import Database

Need = Literal["read", "agent", "operator"]

async def get_db(request: Request) -> Database:
    db: Database = request.app.state.db
    return db


async def get_writer(request: Request) -> IngestWriter:
    w: IngestWriter = request.app.state.ingest_writer
    return w


async def get_clock(request: Request) -> Clock:
    clock: Clock = getattr(request.app.state, "clock", time.time)
    return clock


async def get_straggler_config(request: Request) -> StragglerConfig:
    """The straggler detector's configuration the evaluator judges with (the scores the API
    and the dashboard show are computed with it)."""
    cfg: StragglerConfig = request.app.state.evaluator.detection.straggler
    return cfg


async def get_settings(request: Request) -> SupervisorSettings:
    s: SupervisorSettings = request.app.state.settings
    return s


@dataclass(frozen=True)
class Principal:
    role: Literal["operator", "agent", "anonymous"]


def _matches(presented_hash: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(presented_hash, expected)


class TokenCheck:
    """The single authorisation check.  ``need``: read (any token, or none when reads are
    public), agent (the agent or the operator token), operator (the operator token).

    It reads the header and the settings itself instead of through sub-dependencies: on the
    ingest path every resolved dependency costs measurable time per request.  The bearer
    scheme is declared in the OpenAPI document by ``supervisor.app``."""

    def __init__(self, need: Need) -> None:
        self.need = need

    async def __call__(self, request: Request) -> Principal:
        auth: AuthConfig = request.app.state.settings.auth
        agent_hash, op_hash = auth.agent_token_hash, auth.operator_token_hash
        if agent_hash is None and op_hash is None:
            # Only reachable with insecure_no_auth on a loopback address (see config).
            return Principal("operator")
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            if self.need == "read" and auth.public_reads:
                return Principal("anonymous")
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing bearer token: send 'Authorization: Bearer <token>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        presented = "sha256:" + hashlib.sha256(token.strip().encode()).hexdigest()
        if _matches(presented, op_hash):
            return Principal("operator")
        if _matches(presented, agent_hash):
            if self.need == "operator":
                raise HTTPException(
                    status.HTTP_403_FORBIDDEN, "this route needs the operator token"
                )
            return Principal("agent")
        raise HTTPException(
            status.HTTP_401_UNAUTHORIZED, "invalid token", headers={"WWW-Authenticate": "Bearer"}
        )


DB = Annotated[Database, Depends(get_db)]
ClockDep = Annotated[Clock, Depends(get_clock)]
Writer = Annotated[IngestWriter, Depends(get_writer)]
Settings = Annotated[SupervisorSettings, Depends(get_settings)]
Straggler = Annotated[StragglerConfig, Depends(get_straggler_config)]
ReadAuth = Annotated[Principal, Depends(TokenCheck("read"))]
AgentAuth = Annotated[Principal, Depends(TokenCheck("agent"))]
OperatorAuth = Annotated[Principal, Depends(TokenCheck("operator"))]

"""Token routes (admin only): create a token with a role and an optional run scope, list
them (never their secrets), revoke one."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request, status
from pydantic import BaseModel, Field

from trainwarden.agent.core.names import RUN_SCOPE_PATTERN
from trainwarden.supervisor.api.deps import DB, AdminAuth, ClockDep
from trainwarden.supervisor.api.errors import ERROR_RESPONSES
from trainwarden.supervisor.api.responses import NewToken, TokenList, TokenRevoked, documented
from trainwarden.supervisor.contract.limits import TokenName
from trainwarden.supervisor.enums import Role
from trainwarden.supervisor.store import tokens

router = APIRouter(tags=["tokens"], responses=ERROR_RESPONSES)


class TokenRequest(BaseModel):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")
    role: Role
    scope: str | None = Field(
        default=None, max_length=201, pattern=RUN_SCOPE_PATTERN,
        description="viewer, agent and operator tokens: one run's name, or a run-name "
                    "prefix ending in '*'; the token reads and acts on those runs only; "
                    "none: every run")


@router.post("/tokens", response_model=None, status_code=201,
             responses=documented(NewToken, 201))
def create_token(req: TokenRequest, db: DB, clock: ClockDep, _auth: AdminAuth
                 ) -> dict[str, Any]:
    """A new token; the reply's ``token`` is its secret, shown this once (stored hashed)."""
    if req.scope is not None and req.role == "admin":
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            "an admin token has no scope: it holds the token routes, which "
                            "are not a run's; scope a viewer, agent or operator token")
    try:
        with db.write() as conn:
            row, secret = tokens.create(conn, name=req.name, role=req.role, scope=req.scope,
                                        now=clock())
    except tokens.NameTaken:
        raise HTTPException(status.HTTP_409_CONFLICT,
                            f"a token named {req.name!r} exists: revoke it first or choose "
                            "another name") from None
    return {**row, "token": secret}


@router.get("/tokens", response_model=None, responses=documented(TokenList))
def list_tokens(db: DB, _auth: AdminAuth) -> dict[str, Any]:
    with db.read() as conn:
        return {"tokens": tokens.list_tokens(conn)}


@router.delete("/tokens/{name}", response_model=None, responses=documented(TokenRevoked))
def revoke_token(name: TokenName, request: Request, db: DB, _auth: AdminAuth
                 ) -> dict[str, Any]:
    """Revoke a token: refused from now on (by this supervisor at once)."""
    with db.write() as conn:
        if not tokens.revoke(conn, name=name):
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"no token named {name!r}")
    request.app.state.stored_tokens.forget()
    return {"revoked": name}

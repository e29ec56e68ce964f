"""The health ledger's routes: every known node with its state and evidence, one node's
ledger, and the operator's cordon and uncordon (audited host actions naming who and why).

Hosts span runs, so these routes take a token without a run scope (a scoped token is
refused, as on ``/metrics``; reads are open to it only where reads are public).  A node is
named as its agent registers (``--node``, the hostname by default); an operator may cordon
a node no agent registered yet (a host fenced off before it joins), never one already
cordoned; an uncordon puts a cordoned node on probation, never straight back to healthy."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Request, status
from pydantic import BaseModel, Field, field_validator

from trainwarden.supervisor.api.deps import (
    DB,
    ClockDep,
    OperatorAuth,
    Principal,
    ReadAuth,
    Settings,
    reads_are_public,
)
from trainwarden.supervisor.api.errors import ERROR_RESPONSES
from trainwarden.supervisor.api.responses import HostChanged, HostDetail, HostList, documented
from trainwarden.supervisor.contract.limits import (
    TEXT,
    TEXT_PATTERN,
    TEXT_REFUSES,
    HostName,
    NodeName,
)
from trainwarden.supervisor.control import actions, policy
from trainwarden.supervisor.enums import HostState
from trainwarden.supervisor.store import hosts
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.hosts import HostStateError

router = APIRouter(tags=["hosts"], responses=ERROR_RESPONSES)

REASON_MAX = 1000


class HostChange(BaseModel):
    """Why (kept in the audit trail, with who)."""

    reason: Annotated[str, TEXT] = Field(
        min_length=1, max_length=REASON_MAX, json_schema_extra={"pattern": TEXT_PATTERN},
        description=f"why, for the audit trail (1 to {REASON_MAX} characters, not only "
                    f"spaces; {TEXT_REFUSES})")

    model_config = {"extra": "forbid"}

    @field_validator("reason")
    @classmethod
    def _says_why(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("say why: the reason is kept in the audit trail with who")
        return v.strip()


def _unscoped(principal: Principal, request: Request, *, read: bool) -> None:
    """403 for a token scoped to runs: a node serves every run."""
    if principal.scope is None or (read and reads_are_public(request)):
        return
    raise HTTPException(status.HTTP_403_FORBIDDEN,
                        f"token {principal.token!r} is scoped to {principal.scope!r}: hosts "
                        "serve every run; use a token without a run scope")


def _standing(conn: Connection, node: str) -> dict[str, Any]:
    """The node's state (healthy, since its first agent registered, without a row); 404 for
    a node neither the ledger nor any agent knows."""
    h = hosts.get_host(conn, node=node)
    if h is not None:
        return dict(h)
    seen = hosts.first_registered(conn, node=node)
    if seen is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND,
                            f"unknown node {node!r}: no agent registered it and the ledger "
                            "holds nothing about it")
    return dict(hosts.healthy(node, since=seen))


@router.get("/hosts", response_model=None, responses=documented(HostList))
def list_hosts(db: DB, clock: ClockDep, settings: Settings, request: Request,
               auth: ReadAuth) -> dict[str, Any]:
    """Every known node (registered by an agent of any run, or in the ledger): its state,
    why and since when, how much evidence against it the cordon rule's window holds, and
    its newest evidence."""
    _unscoped(auth, request, read=True)
    window = settings.cordon.window_s
    with db.read() as conn:
        return {"window_s": window,
                "hosts": hosts.host_summaries(conn, since=clock() - window)}


@router.get("/hosts/{node:path}", response_model=None, responses=documented(HostDetail))
def get_host(node: NodeName, db: DB, request: Request, auth: ReadAuth) -> dict[str, Any]:
    """One node's ledger: its state, its evidence and its audited state changes (newest
    first).  404 for a node nothing knows.  (Any name the store may hold is read; a cordon
    takes only the names registration accepts.)"""
    _unscoped(auth, request, read=True)
    with db.read() as conn:
        out = _standing(conn, node)
        out["evidence"] = list(reversed(hosts.evidence(conn, node=node)))
        out["actions"] = hosts.host_actions(conn, node)
    return out


def _change(db: Any, node: str, now: float, decide: Any) -> dict[str, Any]:
    with db.write() as conn:
        h = hosts.get_host(conn, node=node)
        decision = decide(h["state"] if h is not None else HostState.HEALTHY)
        if isinstance(decision, policy.Note):
            raise HTTPException(status.HTTP_409_CONFLICT, f"nothing done: {decision.why}")
        try:
            action_id = actions.apply_host(conn, decision=decision, now=now)
        except HostStateError as e:  # (changed under us by another writer)
            raise HTTPException(status.HTTP_409_CONFLICT, f"nothing done: {e}") from None
        assert action_id is not None
        after = hosts.get_host(conn, node=node)
        assert after is not None
        return {"node": node, "state": after["state"], "action_id": action_id}


@router.post("/hosts/{node:path}/cordon", response_model=None,
             responses=documented(HostChanged))
def cordon(node: HostName, req: HostChange, db: DB, clock: ClockDep, request: Request,
           auth: OperatorAuth) -> dict[str, Any]:
    """Cordon the node (operator): replaced at its run's next restart, never chosen as a
    member while cordoned; restarts nothing by itself.  A node no agent registered yet may
    be cordoned; one cordoned already is 409 (nothing changed)."""
    _unscoped(auth, request, read=False)
    return _change(db, node, clock(), lambda state: policy.operator_cordon(
        node, state=state, reason=req.reason, actor=auth.actor))


@router.post("/hosts/{node:path}/uncordon", response_model=None,
             responses=documented(HostChanged))
def uncordon(node: HostName, req: HostChange, db: DB, clock: ClockDep, request: Request,
             auth: OperatorAuth) -> dict[str, Any]:
    """Put a cordoned node on probation (operator): healthy again once it passes a
    preflight, cordoned again by a failed one; the evidence before now no longer counts
    against it.  A node that is not cordoned is 409 (nothing changed)."""
    _unscoped(auth, request, read=False)
    return _change(db, node, clock(), lambda state: policy.operator_uncordon(
        node, state=state, reason=req.reason, actor=auth.actor))

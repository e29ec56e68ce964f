"""FastAPI dependencies: the store, the clock, the settings, the straggler detector's
configuration, the one token check, and the per-agent credential check (``AgentCredentials``,
``judge_registration``).

Tests override ``get_db``/``get_clock`` through ``app.dependency_overrides``.  The
dependencies are ``async`` (they do no I/O) so FastAPI does not hop to a thread for each.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Literal

from fastapi import Depends, HTTPException, Request, status

from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.config import AuthConfig, SupervisorSettings
from trainwarden.supervisor.detect.straggler import StragglerConfig
from trainwarden.supervisor.enums import Role
from trainwarden.supervisor.ingest.writer import IngestWriter
from trainwarden.supervisor.store import credentials, tokens
from trainwarden.supervisor.store.credentials import NodeHolder
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.registry import Claim

Need = Literal["read", "agent", "operator", "admin"]

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


# The roles each need admits: reads any token; agent routes an agent's, an operator's (and
# the admin's); operator routes an operator's (and the admin's); the token routes the admin's.
ADMITS: dict[str, frozenset[str]] = {
    "read": frozenset({"viewer", "agent", "operator", "admin"}),
    "agent": frozenset({"agent", "operator", "admin"}),
    "operator": frozenset({"operator", "admin"}),
    "admin": frozenset({"admin"}),
}
SETTINGS_TOKEN = "settings"  # the name a bootstrap token from the settings goes by


@dataclass(frozen=True)
class Principal:
    role: Role | Literal["anonymous"]
    token: str = SETTINGS_TOKEN  # the token's name ("settings": a bootstrap token)
    scope: str | None = None  # a run name, or a prefix ending in "*"; None: every run

    @property
    def actor(self) -> str:
        """What an action row's ``actor`` names: the role, and the token unless it is the
        settings' (``operator`` for the bootstrap operator token, ``operator:ci`` for the
        stored token named ci)."""
        return self.role if self.token == SETTINGS_TOKEN else f"{self.role}:{self.token}"

    @property
    def trusted_for_hosts(self) -> bool:
        """Whether what an agent registered with this token reports about its host (failed
        or passed preflights, ECC/XID, crashes blamed on the machine) moves the shared
        health ledger: a token not scoped to runs is the cluster's own.  A run-scoped
        token's evidence counts against the node in its own run only."""
        return self.scope is None and self.role != "anonymous"

    def covers(self, run: str) -> bool:
        if self.scope is None:
            return True
        if self.scope.endswith("*"):
            return run.startswith(self.scope[:-1])
        return run == self.scope

    def require_run(self, run: str) -> None:
        """403 unless the token's scope covers ``run``."""
        if not self.covers(run):
            raise HTTPException(status.HTTP_403_FORBIDDEN,
                                f"token {self.token!r} is scoped to {self.scope!r}: "
                                f"run {run!r} is outside it")


def reads_are_public(request: Request) -> bool:
    """``auth.public_reads``: anyone may read every run (a scoped token's reads are then not
    confined to its runs either)."""
    return bool(request.app.state.settings.auth.public_reads)


def can_read(request: Request, principal: Principal, run: str) -> bool:
    """Whether ``principal`` may read ``run``: its scope covers it, or reads are public."""
    return reads_are_public(request) or principal.covers(run)


def _matches(presented_hash: str, expected: str | None) -> bool:
    return expected is not None and hmac.compare_digest(presented_hash, expected)


class StoredTokens:
    """The stored tokens by digest, cached for ``ttl_s`` (a token revoked here is dropped at
    once; one revoked through another process within ``ttl_s``).  ``last_used_at`` is
    written at most every ``touch_s`` per token: no write per request."""

    def __init__(self, ttl_s: float = 5.0, touch_s: float = 60.0) -> None:
        self.ttl_s, self.touch_s = ttl_s, touch_s
        self._cache: dict[str, tuple[float, tokens.TokenRow | None]] = {}
        self._touched: dict[str, float] = {}

    def forget(self) -> None:
        self._cache.clear()

    def lookup(self, db: Database, secret_hash: str, now: float) -> tokens.TokenRow | None:
        hit = self._cache.get(secret_hash)
        if hit is None or now - hit[0] > self.ttl_s:
            with db.read() as conn:
                row = tokens.by_digest(conn, secret_hash=secret_hash)
            if len(self._cache) > 10_000:
                self._cache.clear()  # bounded: unknown digests are cached too
            self._cache[secret_hash] = (now, row)
        else:
            row = hit[1]
        if row is not None and now - self._touched.get(row["name"], float("-inf")) > self.touch_s:
            self._touched[row["name"]] = now
            with db.write() as conn:
                tokens.touch(conn, name=row["name"], now=now)
        return row


class TokenCheck:
    """The single authorisation check.  ``need``: read (any token, or none when reads are
    public), agent (an agent, operator or admin token), operator (an operator or admin
    token), admin (an admin token).  The settings' tokens are checked first (no store
    access: the ingest path); then the stored tokens (``StoredTokens``).

    It reads the header and the settings itself instead of through sub-dependencies: on the
    ingest path every resolved dependency costs measurable time per request.  The bearer
    scheme is declared in the OpenAPI document by ``trainwarden.supervisor.server.app``."""

    def __init__(self, need: Need) -> None:
        self.need = need

    async def __call__(self, request: Request) -> Principal:
        principal = await self.principal(request)
        # Scope holds on every route that names a run (its ``{run}`` path parameter): reads
        # too, unless reads are public (then anyone may read every run anyway).
        run = request.path_params.get("run")
        if isinstance(run, str) and not self.reads_unscoped(request):
            principal.require_run(run)
        return principal

    def reads_unscoped(self, request: Request) -> bool:
        """Reads of other runs than a scoped token's own: only where reads are public."""
        return self.need == "read" and reads_are_public(request)

    async def principal(self, request: Request) -> Principal:
        """Who the request's token is, with the role this check needs (401/403 otherwise);
        the token's run scope is not checked here (``__call__`` does)."""
        auth: AuthConfig = request.app.state.settings.auth
        agent_hash, op_hash = auth.agent_token_hash, auth.operator_token_hash
        admin_hash = auth.admin_token_hash
        if agent_hash is None and op_hash is None and admin_hash is None:
            # Only reachable with insecure_no_auth on a loopback address (see config); no
            # token routes then (there is no admin to hold them).
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
        principal: Principal | None = None
        if _matches(presented, agent_hash):
            principal = Principal("agent")
        elif _matches(presented, op_hash):
            principal = Principal("operator")
        elif _matches(presented, admin_hash):
            principal = Principal("admin")
        else:
            clock: Clock = getattr(request.app.state, "clock", time.time)
            row = request.app.state.stored_tokens.lookup(request.app.state.db, presented,
                                                         clock())
            if row is not None:
                principal = Principal(row["role"], token=row["name"], scope=row["scope"])
        if principal is None:
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "invalid token",
                                headers={"WWW-Authenticate": "Bearer"})
        if principal.role not in ADMITS[self.need]:
            what = {"agent": "an agent", "operator": "an operator",
                    "admin": "an admin"}.get(self.need, "a")
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"this route needs {what} token (the {self.need} role or above); token "
                f"{principal.token!r} has the {principal.role} role")
        if (self.need == "agent" and auth.scoped_agents_only and principal.role == "agent"
                and principal.scope is None):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"token {principal.token!r} is an agent token scoped to no run, and this "
                "supervisor admits only run-scoped agent tokens (auth.scoped_agents_only): "
                "mint one per job, for example trainwarden token create job-42 --role agent "
                "--scope RUN")
        return principal


DB = Annotated[Database, Depends(get_db)]
ClockDep = Annotated[Clock, Depends(get_clock)]
Writer = Annotated[IngestWriter, Depends(get_writer)]
Settings = Annotated[SupervisorSettings, Depends(get_settings)]
Straggler = Annotated[StragglerConfig, Depends(get_straggler_config)]
ReadAuth = Annotated[Principal, Depends(TokenCheck("read"))]
AgentAuth = Annotated[Principal, Depends(TokenCheck("agent"))]
OperatorAuth = Annotated[Principal, Depends(TokenCheck("operator"))]
AdminAuth = Annotated[Principal, Depends(TokenCheck("admin"))]


# ---- the per-agent credential ----------------------------------------------------------------

CREDENTIAL_HEADER = "X-Trainwarden-Agent-Credential"
# On a 403 for the credential (not the token): the agent registers again to get a new one.
CREDENTIAL_REFUSED_HEADER = "X-Trainwarden-Credential"


def presented_credential(request: Request) -> str | None:
    value = request.headers.get(CREDENTIAL_HEADER)
    return value.strip() if value and value.strip() else None


def _refused(why: str) -> HTTPException:
    return HTTPException(status.HTTP_403_FORBIDDEN, why,
                         headers={CREDENTIAL_REFUSED_HEADER: "invalid"})


# Replicas on one Postgres: how often each reads the credentials another replica changed
# (the bound on a takeover there reaching this one), and how far back it reads them (a
# margin for the replicas' clocks, which stamp the changes).
CREDENTIAL_REFRESH_S = 2.0
CREDENTIAL_REFRESH_WINDOW_S = 60.0


class AgentCredentials:
    """The check that a batch comes from the agent it names: the digest of the presented
    credential against the agent's, cached per agent (one dict lookup and one SHA-256 per
    batch).  Registration and takeover update the cache in this process; a digest that does
    not match the cached one is read again from the store before the batch is refused.

    On a store replicas share (``refresh_s`` set: Postgres), another replica may replace or
    revoke a credential: every ``refresh_s`` one query reads the credentials changed in the
    last ``CREDENTIAL_REFRESH_WINDOW_S`` and the cached digests take their value, so a
    takeover on one replica is refused by every other within ``refresh_s``."""

    _UNKNOWN = object()

    def __init__(self, *, refresh_s: float | None = None, clock: Clock = time.time) -> None:
        self._digests: dict[int, str | None] = {}
        self._runs: dict[int, str] = {}  # agent id -> its run's name (never changes)
        self.refresh_s = refresh_s
        self.clock = clock
        self._refreshed_at = clock()
        self._next_refresh = self._refreshed_at + (refresh_s or 0.0)

    def _refresh(self, db: Database, now: float) -> None:
        with db.read() as conn:
            changed = credentials.changed_since(
                conn, since=self._refreshed_at - CREDENTIAL_REFRESH_WINDOW_S)
        for agent_id, digest in changed.items():
            if agent_id in self._digests:
                self._digests[agent_id] = digest
        self._refreshed_at, self._next_refresh = now, now + (self.refresh_s or 0.0)

    def forget_agents(self, agent_ids: list[int]) -> None:
        """These agents' credentials were revoked: refused from the next batch on."""
        for agent_id in agent_ids:
            self._digests[agent_id] = None

    def remember(self, agent_id: int, digest: str | None, run: str | None = None) -> None:
        self._digests[agent_id] = digest
        if run is not None:
            self._runs[agent_id] = run

    def check(self, db: Database, agent_id: int, presented: str | None,
              principal: Principal | None = None) -> None:
        """Raise 403 unless ``presented`` is the agent's credential, and the token
        (``principal``) may write for the agent's run (its scope); an agent the store does
        not know passes (the ingest answers 404 then, and stores nothing)."""
        if self.refresh_s is not None and (now := self.clock()) >= self._next_refresh:
            self._refresh(db, now)
        digest = credentials.digest(presented) if presented is not None else None
        cached = self._digests.get(agent_id, self._UNKNOWN)
        if digest is not None and isinstance(cached, str) \
                and hmac.compare_digest(digest, cached):
            self._require_scope(principal, agent_id)
            return
        with db.read() as conn:
            key = credentials.agent_key(conn, agent_id=agent_id)
        if key is None:
            self._digests.pop(agent_id, None)
            return
        held = key.secret_hash
        self._digests[agent_id] = held
        self._runs[agent_id] = key.run
        if digest is None:
            raise _refused(f"missing agent credential: send the credential the registration "
                           f"of agent {agent_id} returned in the {CREDENTIAL_HEADER} header")
        if held is None or not hmac.compare_digest(digest, held):
            raise _refused(f"this credential is not agent {agent_id}'s (revoked, replaced by "
                           "a newer registration of its node, or another agent's): register "
                           "again to get the agent's current credential")
        self._require_scope(principal, agent_id)

    def _require_scope(self, principal: Principal | None, agent_id: int) -> None:
        """The token's scope is checked at ingest as at registration (a token scoped to
        team-a-* writes for team-a's agents only)."""
        if principal is None or principal.scope is None:
            return
        run = self._runs.get(agent_id)
        if run is None or not principal.covers(run):
            raise HTTPException(
                status.HTTP_403_FORBIDDEN,
                f"token {principal.token!r} is scoped to {principal.scope!r}: agent "
                f"{agent_id} writes for run {run!r}, outside it")


async def get_credentials(request: Request) -> AgentCredentials:
    c: AgentCredentials = request.app.state.agent_credentials
    return c


def judge_registration(*, run: str, node: str, presented: str | None, takeover: bool,
                       principal: Principal, now: float, live_s: float
                       ) -> Callable[[NodeHolder | None], Claim]:
    """The rule for a (run, node) that already has an agent: the agent proving its
    credential keeps it; a holder heard from within ``live_s`` (the node-lost deadline) is
    only replaced by an operator's takeover (409 otherwise, saying by whom and how); one
    silent for longer, or whose credential an operator revoked, is replaced by the new
    registration.  A credential an operator revoked is refused (409): that agent was
    replaced."""
    if takeover and principal.role not in ADMITS["operator"]:
        raise HTTPException(status.HTTP_403_FORBIDDEN,
                            "a takeover (\"takeover\": true) needs the operator token")
    principal.require_run(run)
    digest = credentials.digest(presented) if presented else None

    def judge(holder: NodeHolder | None) -> Claim:
        if holder is None:
            return "new"
        if digest is not None and holder["secret_hash"] is not None \
                and hmac.compare_digest(digest, holder["secret_hash"]):
            return "proven"
        if takeover:
            return "takeover"
        if digest is not None and holder["revoked_hash"] is not None \
                and hmac.compare_digest(digest, holder["revoked_hash"]):
            raise HTTPException(
                status.HTTP_409_CONFLICT,
                f"node {node!r} of run {run!r} was taken over: this agent's credential was "
                "revoked (an operator's takeover, or a newer agent registered the node after "
                "this one fell silent for longer than the node-lost deadline) and another "
                "agent holds the node. Stop this agent; to run it there again, start it with "
                "a fresh state directory")
        if holder["secret_hash"] is None:
            return "free"
        silent = now - holder["last_seen_at"]
        if silent > live_s:
            return "expired"
        left = live_s - silent
        raise HTTPException(
            status.HTTP_409_CONFLICT,
            f"node {node!r} of run {run!r} is held by agent {holder['agent_id']} (host "
            f"{holder['hostname']!r}, pid {holder['pid']}), heard from {silent:.0f} s ago "
            f"(the node-lost deadline is {live_s:.0f} s). An agent registering again "
            f"presents its credential ({CREDENTIAL_HEADER}, kept in its state directory). "
            f"To replace the agent: stop it and register after {left:.0f} s of silence, or "
            f"take over now with the operator token (POST /api/v1/runs/{run}/nodes/{node}/"
            "takeover, then start the new agent; or register with \"takeover\": true), "
            "which revokes the old agent's credential",
            headers={"Retry-After": str(max(1, int(left) + 1))})

    return judge


Credentials = Annotated[AgentCredentials, Depends(get_credentials)]

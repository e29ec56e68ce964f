"""Tokens with roles (the ``trainwarden token`` commands, ``/api/v1/tokens``): stored as the
SHA-256 digest of a random 256-bit secret.  Keyword-only functions taking a ``Connection``;
who may use which route is ``trainwarden.supervisor.api.deps``'s."""

from __future__ import annotations

import secrets
from typing import TypedDict, cast

from sqlalchemy import Connection, RowMapping, delete, select, update

from trainwarden.supervisor import enums
from trainwarden.supervisor.store.credentials import digest
from trainwarden.supervisor.store.tables import api_tokens

ROLES = enums.ROLES
SECRET_PREFIX = "twt_"


class TokenRow(TypedDict):
    name: str
    role: str
    scope: str | None
    created_at: float
    last_used_at: float | None


class NameTaken(Exception):
    pass


_COLS = (api_tokens.c.name, api_tokens.c.role, api_tokens.c.scope, api_tokens.c.created_at,
         api_tokens.c.last_used_at)


def _row(r: RowMapping) -> TokenRow:
    return cast(TokenRow, dict(r))  # the columns of _COLS: TokenRow's keys


def create(conn: Connection, *, name: str, role: str, scope: str | None, now: float
           ) -> tuple[TokenRow, str]:
    """A new token; returns its row and the secret (shown once, never stored)."""
    if conn.execute(select(api_tokens.c.id).where(api_tokens.c.name == name)).first():
        raise NameTaken(name)
    secret = SECRET_PREFIX + secrets.token_urlsafe(32)
    conn.execute(api_tokens.insert().values(name=name, role=role, scope=scope,
                                            secret_hash=digest(secret), created_at=now))
    return TokenRow(name=name, role=role, scope=scope, created_at=now,
                    last_used_at=None), secret


def list_tokens(conn: Connection) -> list[TokenRow]:
    return [_row(r._mapping)
            for r in conn.execute(select(*_COLS).order_by(api_tokens.c.id))]


def revoke(conn: Connection, *, name: str) -> bool:
    return bool(conn.execute(delete(api_tokens).where(api_tokens.c.name == name)).rowcount)


def by_digest(conn: Connection, *, secret_hash: str) -> TokenRow | None:
    r = conn.execute(select(*_COLS).where(api_tokens.c.secret_hash == secret_hash)).first()
    return _row(r._mapping) if r is not None else None


def touch(conn: Connection, *, name: str, now: float) -> None:
    conn.execute(update(api_tokens).where(api_tokens.c.name == name)
                 .values(last_used_at=now))

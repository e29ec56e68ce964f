"""Browser auth for the dashboard: the operator (or agent) token kept in an HttpOnly cookie.

The cookie only ever authorises *reads*: ``CookieAuth`` turns it into an ``Authorization``
header for GET/HEAD requests that carry none, and the usual ``TokenCheck`` then decides.  A
write (the rollback form) must send the operator token itself, so a forged cross-site POST
gains nothing from the cookie (which is also ``SameSite=Strict``).
"""

from __future__ import annotations

from http.cookies import CookieError, SimpleCookie
from typing import Any
from urllib.parse import parse_qs, urlsplit

from fastapi import HTTPException, Request
from fastapi.responses import Response

from trainwarden.supervisor.api.deps import Principal, TokenCheck, can_read

COOKIE = "trainwarden_token"
COOKIE_MAX_AGE_S = 7 * 24 * 3600
_SAFE = frozenset({"GET", "HEAD"})
CROSS_SITE = ("refused: this form was not sent from the supervisor's own page (Origin/Referer "
              "missing or another site)")


class CookieAuth:
    """Pure ASGI middleware: the token cookie as a bearer header on safe requests."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("method") in _SAFE:
            headers = scope.get("headers") or []
            if not any(k == b"authorization" for k, _ in headers):
                token = _cookie(headers)
                if token:
                    scope = {**scope,
                             "headers": [*headers, (b"authorization", b"Bearer " + token)]}
        await self.app(scope, receive, send)


def _cookie(headers: list[tuple[bytes, bytes]]) -> bytes | None:
    for k, v in headers:
        if k != b"cookie":
            continue
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(v.decode("latin-1"))
        except CookieError:
            continue
        morsel = jar.get(COOKIE)
        if morsel is not None and morsel.value and valid_token_text(morsel.value):
            return morsel.value.encode()
    return None


async def check(request: Request, token: str | None = None) -> Principal | None:
    """The principal of ``token`` (or of the request's own header/cookie when None) under
    the read rule, or None when refused (its run scope is the page's to check:
    ``require_run``)."""
    req = request
    if token is not None:
        headers = [(k, v) for k, v in request.scope["headers"] if k != b"authorization"]
        headers.append((b"authorization", f"Bearer {token}".encode()))
        req = Request({**request.scope, "headers": headers})
    try:
        return await _READ.principal(req)
    except HTTPException:
        return None


_READ = TokenCheck("read")


def require_run(request: Request, principal: Principal, run: str) -> None:
    """403 unless the principal may read ``run`` (the read rule of ``TokenCheck``)."""
    if not _READ.reads_unscoped(request):
        principal.require_run(run)


def readable(request: Request, principal: Principal, run: str) -> bool:
    return can_read(request, principal, run)


def set_cookie(response: Response, request: Request, token: str) -> None:
    response.set_cookie(COOKIE, token, max_age=COOKIE_MAX_AGE_S, httponly=True,
                        samesite="strict", secure=request.url.scheme == "https", path="/")


def clear_cookie(response: Response) -> None:
    response.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")


async def form_token(request: Request) -> str:
    """The ``token`` field of a urlencoded form body (no multipart parser needed)."""
    body = (await request.body()).decode("utf-8", "replace")
    values = parse_qs(body).get("token") or [""]
    return values[0].strip()


def same_origin(request: Request) -> bool:
    """Does the request's ``Origin`` (or, without one, ``Referer``) name the host it was sent
    to?  Browsers send ``Origin`` with every form POST; a request with neither is refused."""
    host = request.headers.get("host")
    source = request.headers.get("origin")
    if source is None:
        source = request.headers.get("referer")
    if not host or not source or source == "null":
        return False
    try:
        parts = urlsplit(source)
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()


def valid_token_text(token: str) -> bool:
    return bool(token) and token.isascii() and token.isprintable() and ";" not in token \
        and len(token) <= 4096

"""Security headers on every response: pages, API, static files, errors, /metrics.

The dashboard and the API docs load only their own scripts, styles and images (uPlot and
Swagger UI are vendored; no inline script or style anywhere), so the Content-Security-Policy
allows nothing but the supervisor's own origin (and ``data:`` images: the favicon and Swagger
UI's icons).  Framing is refused (clickjacking), content types are not sniffed, and the
Referer leaves the supervisor's origin only as nothing (``same-origin``: the login form's
same-origin check still gets an Origin header).

A pure ASGI middleware (no task per request); a header a route already set is left as it is.
"""

from __future__ import annotations

from typing import Any

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; font-src 'self'; object-src 'none'; base-uri 'none'; "
    "form-action 'self'; frame-ancestors 'none'"
)
HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"cross-origin-opener-policy", b"same-origin"),
)


class SecurityHeaders:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                have = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in HEADERS if k not in have]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)

"""Every request body under ``/api/v1`` is JSON, whatever form type the client claimed.

``curl -d '{...}'`` sends ``Content-Type: application/x-www-form-urlencoded`` unless told
otherwise, and FastAPI would then refuse a JSON body with 422.  The API has no form or text
routes, so such a body is read as what it is.  This opens no cross-site hole: every write
needs a bearer token in a header, which a cross-site form cannot send (the dashboard's
cookie authorises reads only).
"""

from __future__ import annotations

from typing import Any

_PREFIX = "/api/v1/"
_READ_AS_JSON = (b"application/x-www-form-urlencoded", b"text/plain")


class JsonApiBodies:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PREFIX):
            headers = scope["headers"]
            for i, (name, value) in enumerate(headers):
                if name == b"content-type" and value.split(b";")[0].strip().lower() \
                        in _READ_AS_JSON:
                    headers = list(headers)
                    headers[i] = (b"content-type", b"application/json")
                    scope = {**scope, "headers": headers}
                    break
        await self.app(scope, receive, send)

"""JSON rendering that keeps NaN readable, and the 422 answer for invalid requests."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse


def _finite_json(obj: Any) -> Any:
    # Browsers' JSON.parse refuses NaN tokens: non-finite floats go out as the strings
    # "NaN", "Infinity", "-Infinity" (the protobuf JSON mapping's spelling).
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_json(v) for v in obj]
    return obj


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        try:
            return json.dumps(content, allow_nan=False, separators=(",", ":")).encode()
        except ValueError:
            return json.dumps(_finite_json(content), separators=(",", ":")).encode()


def validation_error_response(
    errors: Sequence[Any], *, prefix: tuple[str, ...] = ()
) -> SafeJSONResponse:
    """422 with one readable line per problem.  The input values are left out: they may be
    large, or NaN, which JSON cannot carry."""
    out = [
        {"loc": [*prefix, *(str(p) for p in e.get("loc", ()))], "msg": e.get("msg", ""),
         "type": e.get("type", "")}
        for e in errors
    ]
    text = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in out[:20])
    return SafeJSONResponse(status_code=422,
                            content={"detail": f"invalid request: {text}", "errors": out})

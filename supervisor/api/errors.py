"""JSON rendering that keeps NaN readable, the error bodies of the API, and the 422 answer
for invalid requests.

Every error the API answers is ``{"detail": "<one readable line>"}``; a 422 adds ``errors``,
one entry per problem (where, what, which kind).  The models below are what the OpenAPI
declares for them (``ERROR_RESPONSES``, on every router), so the declared schema and the
actual bodies are one definition."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field


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


class ErrorBody(BaseModel):
    """Any error answer of the API."""

    detail: str = Field(description="what went wrong, in one line")


class FieldError(BaseModel):
    loc: list[str] = Field(description='where: ["body", "items", "0", "step", "t"]')
    msg: str
    type: str = Field(description="the kind of problem (pydantic's error type)")


class ValidationErrorBody(ErrorBody):
    """A 422: the request is not valid.  ``errors`` lists the problems (empty when the
    request is well-formed but refused as a whole, e.g. a range whose end is below its
    start)."""

    errors: list[FieldError] = Field(default_factory=list)


class SeqConflictBody(ErrorBody):
    """A 409 of ``/ingest``: the batch's (agent_id, seq) was already stored with different
    content."""

    next_seq: int = Field(description="the agent's first sequence number not stored yet")


def _error(model: type[BaseModel], what: str) -> dict[str, Any]:
    return {"model": model, "description": what}


# The error answers of the API routes (FastAPI's ``responses=``).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: _error(ErrorBody, "Malformed request (a Content-Length that is not a number)"),
    401: _error(ErrorBody, "Missing or invalid bearer token"),
    403: _error(ErrorBody, "The token's role does not allow this route"),
    404: _error(ErrorBody, "Unknown run, agent, checkpoint or action"),
    409: _error(ErrorBody, "Refused in the current state"),
    413: _error(ErrorBody, "Request body over the configured limit"),
    422: _error(ValidationErrorBody, "Invalid request: each problem in `errors`"),
}


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

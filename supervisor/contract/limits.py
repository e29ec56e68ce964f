"""Limits on what a request may carry, in one place: the bounds of every number and text
field of the wire and API request models (documented in the OpenAPI through them), and the
request body size (refused with 413 before it is parsed).

The bounds are what both stores hold: ids, sequence numbers, byte counts and batch indices
fit a 64-bit integer (Postgres BIGINT, SQLite's integers); steps, ranks, attempts, pids and
the ids of the INTEGER tables fit Postgres' 32-bit INTEGER.  Durations must be finite; an
agent's times (``t``, ``sent_at``) may be any number, NaN included: ingest checks them against
the supervisor's clock and stores the receive time for one that is not finite or far off
(``IngestConfig``), so a broken clock costs its times, not its batch.  Loss and grad norm
keep NaN/Infinity (a NaN loss is a signal).  Text never holds NUL (Postgres text cannot) or
terminal control characters.  A value out of bounds is a 422 naming the field, never a store
error.

The body size check is a pure ASGI middleware (Starlette's BaseHTTPMiddleware costs a task
per request): the Content-Length is checked up front; a body without one is counted as it
streams in.
"""

from __future__ import annotations

import json
from re import Pattern
from typing import Annotated, Any

from fastapi import HTTPException, Path
from pydantic import AfterValidator, Field

from trainwarden.agent.core import text as untrusted
from trainwarden.agent.core.names import RUN_NAME_MAX

Scope = dict[str, Any]
Message = dict[str, Any]

# ---- numbers -------------------------------------------------------------------------------

INT32_MAX = 2**31 - 1  # Postgres INTEGER
INT64_MAX = 2**63 - 1  # Postgres BIGINT, SQLite INTEGER

# 0 <= x <= 2^31-1: steps, ranks, attempts, counts, pids, ids of the INTEGER tables.
U31 = Annotated[int, Field(ge=0, le=INT32_MAX)]
# 0 <= x <= 2^63-1: sequence numbers, byte counts, batch indices.
U63 = Annotated[int, Field(ge=0, le=INT64_MAX)]
# -2^31 <= x <= 2^31-1: exit codes (negative: the signal that ended the process).
I32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
# 1 <= x <= 2^31-1.
Positive31 = Annotated[int, Field(ge=1, le=INT32_MAX)]
# A declared one-device throughput (samples or tokens per second, ``declare_flops``'s
# ``baseline_per_device``): positive, at most this; anything else reads as not declared.
BASELINE_PER_DEVICE_MAX = 1e12
# Unix times and durations: finite (NaN and Infinity are refused).
Finite = Annotated[float, Field(allow_inf_nan=False,
                                description="a finite number (NaN and Infinity are refused)")]
# An agent's Unix time: any number; one not finite, or beyond the allowed clock skew, is
# stored as the time the supervisor received it (and counted in a clock_skew event).
AgentTime = Annotated[float, Field(
    allow_inf_nan=True, description="Unix time by the agent's clock; not finite or beyond "
    "ingest.clock_ahead_s / clock_behind_s of the supervisor's: stored as the receive time")]

# ---- text ----------------------------------------------------------------------------------

# One-line text (names, paths, versions): no C0 control (U+0000-U+001F, tab and newline
# included), no DEL, no C1 control (U+0080-U+009F; U+009B is CSI on its own).
LINE_PATTERN = r"^[^\x00-\x1f\x7f-\x9f]*$"
# Free text (messages, reasons): the same, except tab, newline and carriage return.
TEXT_PATTERN = r"^[^\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]*$"
LINE_REFUSES = "control characters (U+0000-U+001F, U+007F-U+009F) are refused"
TEXT_REFUSES = ("control characters (U+0000-U+001F except tab, newline and carriage return; "
                "U+007F-U+009F) are refused")
MAX_PATH = 4096  # PATH_MAX
MAX_TEXT = untrusted.MAX_TEXT  # a message, a reason, a command's result

_LINE_BAD = untrusted.LINE_CONTROLS
_TEXT_BAD = untrusted.TEXT_CONTROLS


def _checker(bad: Pattern[str], what: str) -> Any:
    def check(v: str) -> str:
        m = bad.search(v)
        if m is not None:
            raise ValueError(f"{what}: found U+{ord(m.group()):04X} at offset {m.start()}")
        return v
    return AfterValidator(check)


# The validators: ``Line``/``Text`` carry them, ``line()``/``text()`` the length and the docs.
LINE = _checker(_LINE_BAD, LINE_REFUSES)
TEXT = _checker(_TEXT_BAD, TEXT_REFUSES)
Line = Annotated[str, LINE]
Text = Annotated[str, TEXT]


def line(default: Any = ..., *, max_length: int, min_length: int | None = None,
         description: str = "") -> Any:
    """A one-line text field (``name: Line = line(...)``): at most ``max_length``
    characters, no control characters."""
    return Field(default, max_length=max_length, min_length=min_length,
                 description=_describe(description, f"at most {max_length} characters; "
                                                    f"{LINE_REFUSES}"),
                 json_schema_extra={"pattern": LINE_PATTERN})


def text(default: Any = "", *, max_length: int = MAX_TEXT, description: str = "") -> Any:
    """A free-text field (``message: Text = text(...)``): several lines allowed."""
    return Field(default, max_length=max_length,
                 description=_describe(description, f"at most {max_length} characters; "
                                                    f"{TEXT_REFUSES}"),
                 json_schema_extra={"pattern": TEXT_PATTERN})


def _describe(what: str, bounds: str) -> str:
    return f"{what} ({bounds})" if what else bounds[0].upper() + bounds[1:]


# Free text an agent sends (a worker's last words, an event's message, a command's result):
# kept, made harmless by the one rule for untrusted text (``trainwarden.agent.core.text.clean``:
# controls shown escaped, lone surrogates replaced, cut at MAX_TEXT characters with a marker).
# A crash report is evidence: refusing it for what the dying worker wrote would lose it.
AGENT_TEXT_RULE = (f"control characters are kept as visible escapes (\\x00), longer text is "
                   f"cut at {untrusted.MAX_TEXT} characters with a marker")
AgentText = Annotated[str, AfterValidator(untrusted.clean), Field(description=AGENT_TEXT_RULE)]
# A JSON object an agent sends (an event's details): every string in it (keys included)
# cleaned by the same rule, nesting bounded.
AgentJSON = Annotated[dict[str, Any], AfterValidator(untrusted.clean_json),
                      Field(description="a JSON object; every string in it: " + AGENT_TEXT_RULE)]

# One argument of a command line (tabs and newlines may be part of one).
Arg = Annotated[str, TEXT, Field(max_length=MAX_PATH, json_schema_extra={"pattern": TEXT_PATTERN})]

# A run's name: what registration accepts (``RUN_NAME_PATTERN``, ``RUN_NAME_MAX``: the rule
# the agent checks too, ``trainwarden.agent.core.names``).
# The run path parameter of the API: any name the store can hold (a run written there by
# other means than registration is still addressable), never a NUL (Postgres text has none).
RunName = Annotated[str, Path(max_length=RUN_NAME_MAX, pattern=r"^[^\x00]+$",
                              description="the run's name (a NUL is refused)")]

# A node's name in a path (``/runs/{run}/nodes/{node}/...``): any name registration accepts,
# slashes included (``rack1/n0``), never a NUL.
NodeName = Annotated[str, Path(max_length=200, pattern=r"^[^\x00]+$",
                               description="the node's name as its agent registered it "
                                           "(slashes allowed; a NUL is refused)")]
# A node of the health ledger in a path (``/hosts/{node}``): what registration accepts as a
# node's name (one line, no control character, slashes allowed), since an operator may name a
# node before its agent registers.
HostName = Annotated[str, Path(min_length=1, max_length=200, pattern=LINE_PATTERN,
                               description="the node's name as its agent registers it "
                                           "(--node, the hostname by default; slashes "
                                           f"allowed; {LINE_REFUSES})")]
# A stored token's name in a path: never a NUL (no token has one).
TokenName = Annotated[str, Path(max_length=100, pattern=r"^[^\x00]+$",
                                description="the token's name (a NUL is refused)")]

# ---- the request body ----------------------------------------------------------------------


class BodyTooLarge(HTTPException):
    """Raised while the body streams in; an HTTPException so that FastAPI's body reader passes
    it through as the 413 answer instead of wrapping it in a 400."""

    def __init__(self, detail: str) -> None:
        super().__init__(status_code=413, detail=detail)


class BodySizeLimit:
    def __init__(self, app: Any, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await refused_declared_length(scope, send, self.max_bytes):
            return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            msg: Message = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(body_too_large(seen, self.max_bytes))
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await refuse_body(send, 413, body_too_large(seen, self.max_bytes))


async def refused_declared_length(scope: Any, send: Any, max_bytes: int) -> bool:
    """Answer 400 (a Content-Length that is not a number) or 413 (one over ``max_bytes``)
    before the body is read; whether it did."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                declared = int(value)
            except ValueError:
                await refuse_body(send, 400, "Content-Length is not a number")
                return True
            if declared > max_bytes:
                await refuse_body(send, 413, body_too_large(declared, max_bytes))
                return True
            break
    return False


def body_too_large(n: int, max_bytes: int) -> str:
    return f"request body of {n} bytes is over the limit of {max_bytes} bytes"


async def refuse_body(send: Any, code: int, detail: str) -> None:
    """Answer ``code`` with ``{"detail": ...}`` (the body was not read, or not all of it)."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": code,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

"""Read deadlines for the supervisor's HTTP connections.

uvicorn closes an idle keep-alive connection (``timeout_keep_alive``) and answers 503 past a
connection cap (``limit_concurrency``), but nothing bounds how long a client may take to
*send* a request: a connection that opens and says nothing, or sends its headers or body a
byte every few seconds, is held forever, and enough of them exhaust the server.  This module
adds two deadlines to uvicorn's own protocol class (the one ``http="auto"`` would pick:
httptools where it is installed, else h11), without touching how it parses:

- the request's headers must be complete within ``header_timeout_s`` of the connection
  opening (the first request) or of the first byte after the previous response (the idle
  wait in between is uvicorn's keep-alive timeout);
- its body must be complete within ``body_timeout_s`` of its headers.

They are totals, not idle timers, so trickling a byte at a time does not extend them.  Past a
deadline the client gets ``408 Request Timeout`` (when it had sent part of a request) and the
connection is closed.  While the application works on a complete request no deadline runs.

The phase of a connection is read from the protocol's own state after every event (the
current request-response cycle, whether its body is complete, whether its response is), so
the guard follows uvicorn's parser instead of parsing HTTP a second time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("trainwarden.supervisor")


_408_BODY = b"request not received in time\n"
_408 = (b"HTTP/1.1 408 Request Timeout\r\n"
        b"content-type: text/plain; charset=utf-8\r\n"
        b"x-content-type-options: nosniff\r\n"
        b"content-length: " + str(len(_408_BODY)).encode() + b"\r\n"
        b"connection: close\r\n\r\n" + _408_BODY)

# (what is awaited, the cycle it belongs to): "headers" of the next request (the cycle is the
# previous one, or None on a fresh connection), or the "body" of the cycle's request.  Each
# phase has its deadline; a new phase (another tag or another cycle) starts a new one.
_Phase = tuple[str, Any]


class _ReadDeadlines:
    """Mixin over a uvicorn HTTP protocol class (``cycle``, ``transport``, ``loop``,
    ``connection_made``, ``data_received``, ``on_response_complete``, ``connection_lost``)."""

    header_timeout_s: float
    body_timeout_s: float
    cycle: Any
    transport: Any
    loop: asyncio.AbstractEventLoop

    def connection_made(self, transport: Any) -> None:
        self._phase: _Phase | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._next_begun = False  # bytes of the next request arrived (since the last response)
        # (a mixin: uvicorn's protocol class is the base at run time)
        super().connection_made(transport)  # type: ignore[misc]
        self._watch()

    def data_received(self, data: bytes) -> None:
        if data and (self.cycle is None or self.cycle.response_complete):
            self._next_begun = True
        # (a mixin: uvicorn's protocol class is the base at run time)
        super().data_received(data)  # type: ignore[misc]
        self._watch()

    def on_response_complete(self) -> None:
        self._next_begun = False
        # (a mixin: uvicorn's protocol class is the base at run time)
        super().on_response_complete()  # type: ignore[misc]
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        # (a mixin: uvicorn's protocol class is the base at run time)
        super().connection_lost(exc)  # type: ignore[misc]

    # -- the deadlines ---------------------------------------------------------------------

    def _awaiting(self) -> _Phase | None:
        cycle = self.cycle
        if cycle is None:
            return ("headers", None)  # a fresh connection: its first request's headers
        if cycle.response_complete:
            # Between requests: idle until a byte comes (uvicorn's keep-alive timer runs).
            return ("headers", cycle) if self._next_begun else None
        if cycle.more_body:
            return ("body", cycle)
        return None  # a complete request the application is working on

    def _watch(self) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        phase = self._awaiting()
        old = self._phase
        if phase is not None and old is not None and phase[0] == old[0] and phase[1] is old[1]:
            return  # the same wait goes on: its deadline stands
        self._cancel()
        self._phase = phase
        if phase is not None:
            limit = self.header_timeout_s if phase[0] == "headers" else self.body_timeout_s
            self._timer = self.loop.call_later(limit, self._expired, phase)

    def _cancel(self) -> None:
        if getattr(self, "_timer", None) is not None:
            assert self._timer is not None
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: _Phase) -> None:
        self._timer = None
        if phase is not self._phase or self.transport.is_closing():
            return
        what, cycle = phase
        started = (what == "headers" and self._next_begun) or (
            what == "body" and not cycle.response_started)
        if started:
            self.transport.write(_408)
        peer = self.transport.get_extra_info("peername")
        log.info("closing connection from %s: request %s not received within %.1f s", peer,
                 what, self.header_timeout_s if what == "headers" else self.body_timeout_s)
        self.transport.close()


def guarded_protocol(*, header_timeout_s: float, body_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's default HTTP protocol class with the read deadlines (pass as ``http=``)."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as base
    except ImportError:  # the same fallback as uvicorn's http="auto"
        # (the other protocol class under the same name)
        from uvicorn.protocols.http.h11_impl import H11Protocol as base  # type: ignore[assignment]
    cls = type(f"Guarded{base.__name__}", (_ReadDeadlines, base),
               {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})
    return cls

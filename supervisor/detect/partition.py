"""Network partition: members alive and heard by the supervisor that cannot reach each other.

A partition between two nodes hangs their collectives (every process stays alive, every
agent keeps heartbeating); the collective timeout ends the attempt, and the restart's
rendezvous cannot form either.  The second failure names the partition: the torchrun of a
member that is not the rendezvous host (node rank 0's node) fails to connect to the host's
store (``DistNetworkError: The client socket has failed to connect to any network address
of (HOST, PORT) ... No route to host``) while the supervisor still hears the host.  That
member cannot reach the host: it is the node cut off (``cut_off``), and a spare that can
takes its rank.  The host's own torchrun fails at the same time with ``Timed out ... waiting
for clients. 1/2 clients joined`` (``not_joined``): it says that some member did not join,
not which, so the policy waits for the member's own report.

The rule, and what it guarantees: the rendezvous host is kept, since the next rendezvous
forms there; the member that cannot reach it is replaced.  With a cut between the host and
one member, the one cut off is the member, and the replacement fixes the run.  A host cut off
from every other node reads as each member unable to reach it: the replaced member's spare
fails the same way, and the no-progress rule ends the run (it is not told apart from the
host being cut off until then).  Silence is not a partition: a member the supervisor does
not hear is judged by the node-lost rules.

Pure: root causes and the supervisor's facts in, an observation out.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from trainwarden.agent.core.rootcause import RootCause

# torch.distributed's TCPStore client, giving up on the store's address (c10d socket.cpp).
_UNREACHED = re.compile(r"failed to connect to any network address of \(\[?([^,\]\s)]+)\]?,"
                        r"\s*(\d+)\)", re.IGNORECASE)
_WHY = re.compile(r"\(errno:\s*\d+\s*-\s*([^)]+)\)|(No route to host|Connection refused|"
                  r"Connection timed out|Network is unreachable)", re.IGNORECASE)
# The TCPStore server (the rendezvous host), giving up on the members that never joined.
_NOT_JOINED = re.compile(r"waiting for clients\.\s*(\d+)/(\d+) clients joined", re.IGNORECASE)


@dataclass(frozen=True)
class Unreached:
    """A store address a node's torchrun could not connect to, and the socket's reason."""

    address: str
    port: int
    why: str = ""

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"


def _said(rc: RootCause | None) -> str:
    return "" if rc is None else f"{rc.exc_type}: {rc.message}\n{rc.traceback}"


def unreached(rc: RootCause | None) -> Unreached | None:
    """The rendezvous store a failure could not connect to, or None."""
    said = _said(rc)
    m = _UNREACHED.search(said)
    if m is None:
        return None
    why = _WHY.search(said[m.end():]) or _WHY.search(said)
    reason = "" if why is None else (why.group(1) or why.group(2) or "").strip()
    return Unreached(address=m.group(1), port=int(m.group(2)), why=reason)


def not_joined(rc: RootCause | None) -> tuple[int, int] | None:
    """(clients joined, clients expected) of a rendezvous host whose store gave up waiting
    for its members, or None."""
    m = _NOT_JOINED.search(_said(rc))
    return None if m is None else (int(m.group(1)), int(m.group(2)))


@dataclass(frozen=True)
class Partition:
    """``cut_off`` cannot reach ``unreachable`` (the rendezvous host); both are heard."""

    cut_off: str
    unreachable: str
    endpoint: str
    why: str = ""

    @property
    def message(self) -> str:
        how = f": {self.why}" if self.why else ""
        return (f"network partition: {self.cut_off} cannot reach {self.unreachable} (the "
                f"rendezvous host, {self.endpoint}{how}), though the supervisor hears both")


def cut_off(node: str, rc: RootCause | None, *, host: str | None,
            silent: Mapping[str, float]) -> Partition | None:
    """A partition, when ``node`` (not the rendezvous host) failed to connect to the
    rendezvous store while the supervisor hears the host (``host`` not among the ``silent``
    members); None otherwise (a silent host is a node lost, not a partition)."""
    if host is None or node == host or host in silent:
        return None
    u = unreached(rc)
    if u is None:
        return None
    return Partition(cut_off=node, unreachable=host, endpoint=u.endpoint, why=u.why)

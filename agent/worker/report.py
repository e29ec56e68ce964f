"""Reporting from inside the training loop to the local agent.

A report is one datagram on the agent's Unix socket (``TRAINWARDEN_AGENT_SOCKET``).  The socket
is non-blocking: when the agent is absent, restarting, or its queue is full, the message is
dropped and counted, and training goes on.  Nothing here raises into the training loop.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any

from agent.protocol import (
    ENV_AGENT_SOCKET,
    ENV_ATTEMPT,
    MAX_DATAGRAM_BYTES,
    PROTOCOL_VERSION,
    encode_datagram,
)


def current_attempt() -> int:
    """The run attempt this process belongs to (set by the agent; 0 without one)."""
    try:
        return int(os.environ.get(ENV_ATTEMPT, "0"))
    except ValueError:
        return 0


class Reporter:
    """Sends worker messages to the agent's datagram socket without ever blocking."""

    def __init__(self, socket_path: str | None = None, *, rank: int | None = None,
                 local_rank: int | None = None, world_size: int | None = None) -> None:
        self.path = socket_path if socket_path is not None else os.environ.get(ENV_AGENT_SOCKET)
        self.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        self.local_rank = (local_rank if local_rank is not None
                           else int(os.environ.get("LOCAL_RANK", "0")))
        self.world_size = (world_size if world_size is not None
                           else int(os.environ.get("WORLD_SIZE", "1")))
        self.attempt = current_attempt()
        self.pid = os.getpid()
        self.sent = 0
        self.dropped = 0
        self._sock: socket.socket | None = None
        if self.path:
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            except OSError:
                self._sock = None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; returns False (and counts a drop) instead of raising."""
        sock = self._sock
        if sock is None:
            self.dropped += 1
            return False
        try:
            data = encode_datagram(message)  # type: ignore[arg-type]
            if len(data) > MAX_DATAGRAM_BYTES:
                self.dropped += 1
                return False
            sock.sendto(data, self.path)  # type: ignore[arg-type]
        except Exception:  # absent agent, full queue, unencodable value: never into training
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def send_blocking(self, message: dict[str, Any], timeout_s: float = 0.5) -> bool:
        """For a process about to exit: wait briefly for queue room instead of dropping."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.send(message):
                return True
            if self._sock is None or time.monotonic() >= deadline:
                return False
            self.dropped -= 1  # retried, not yet dropped
            time.sleep(0.01)

    def step(self, step: int, *, loss: Any = None, samples: int | None = None,
             tokens: int | None = None, lr: float | None = None, grad_norm: Any = None,
             data_s: float | None = None, compute_s: float | None = None,
             step_s: float | None = None, batch_index: int | None = None) -> bool:
        try:
            msg = {
                "type": "step", "v": PROTOCOL_VERSION, "attempt": self.attempt,
                "rank": self.rank, "local_rank": self.local_rank,
                "world_size": self.world_size, "pid": self.pid, "step": int(step),
                "t": time.time(), "batch_index": batch_index,
                "loss": _as_float(loss), "samples": samples, "tokens": tokens,
                "lr": _as_float(lr), "grad_norm": _as_float(grad_norm),
                "data_s": data_s, "compute_s": compute_s, "step_s": step_s,
                "dropped": self.dropped,
            }
        except Exception:
            self.dropped += 1
            return False
        return self.send(msg)

    def event(self, name: str, message: str = "", *, step: int | None = None,
              details: dict[str, Any] | None = None, blocking: bool = False) -> bool:
        msg = {
            "type": "event", "v": PROTOCOL_VERSION, "attempt": self.attempt, "rank": self.rank,
            "local_rank": self.local_rank, "pid": self.pid, "t": time.time(), "name": name,
            "step": step, "message": message[:4000], "details": details or {},
        }
        return self.send_blocking(msg) if blocking else self.send(msg)

    def checkpoint(self, *, step: int, path: str, nbytes: int, save_s: float,
                   async_save: bool, lineage: str) -> bool:
        msg = {
            "type": "checkpoint", "v": PROTOCOL_VERSION, "attempt": self.attempt,
            "rank": self.rank, "t": time.time(), "step": step, "path": path, "bytes": nbytes,
            "save_s": save_s, "async_save": async_save, "lineage": lineage,
        }
        # A checkpoint report is rare and matters: wait briefly for room rather than drop it.
        return self.send_blocking(msg, timeout_s=0.2)


def _as_float(x: Any) -> float | None:
    if x is None:
        return None
    if hasattr(x, "item"):  # a 0-d tensor; .item() syncs a CUDA tensor, so pass floats on GPU
        x = x.item()
    return float(x)


_default: Reporter | None = None


def get_reporter() -> Reporter:
    """The process-wide reporter, configured from the environment on first use."""
    global _default
    if _default is None:
        _default = Reporter()
    return _default


def set_reporter(reporter: Reporter | None) -> None:
    global _default
    _default = reporter


class PhaseTimer:
    """Per-step phase times: data wait, compute before the collective, whole step.

    ``start()`` at the top of the step, ``data_ready()`` once the batch is in hand,
    ``compute_done()`` when this rank's own compute is finished (before it waits on peers), and
    ``stop()`` at the end.  ``compute_done()`` may be called many times (a DDP comm hook calls it
    for every gradient bucket); the last call counts.  Without any call, compute is unknown.
    """

    __slots__ = ("_t0", "_t_compute", "_t_data", "compute_s", "data_s", "step_s")

    def __init__(self) -> None:
        self._t0 = self._t_data = self._t_compute = 0.0
        self.data_s: float | None = None
        self.compute_s: float | None = None
        self.step_s: float | None = None

    def start(self) -> None:
        self._t0 = time.perf_counter()
        self._t_data = self._t_compute = 0.0

    def data_ready(self) -> None:
        self._t_data = time.perf_counter()

    def compute_done(self) -> None:
        self._t_compute = time.perf_counter()

    def stop(self) -> float:
        t = time.perf_counter()
        t_data = self._t_data or self._t0
        self.data_s = t_data - self._t0
        self.compute_s = (self._t_compute - t_data) if self._t_compute else None
        self.step_s = t - self._t0
        return self.step_s


def report_step(step: int, *, loss: Any = None, samples: int | None = None,
                tokens: int | None = None, lr: float | None = None, grad_norm: Any = None,
                data_s: float | None = None, compute_s: float | None = None,
                step_s: float | None = None, batch_index: int | None = None,
                timer: PhaseTimer | None = None) -> None:
    """Report one finished step to the local agent.  Never blocks, never raises.

    ``step`` is the 0-based index of the step just trained.  Phase times come from ``timer``
    when given (after its ``stop()``), else from the keyword arguments.  Pass ``loss`` as a
    Python float where you already have one: a CUDA tensor is synchronised by ``.item()``.
    """
    try:
        if timer is not None:
            data_s, compute_s, step_s = timer.data_s, timer.compute_s, timer.step_s
        get_reporter().step(step, loss=loss, samples=samples, tokens=tokens, lr=lr,
                            grad_norm=grad_norm, data_s=data_s, compute_s=compute_s,
                            step_s=step_s, batch_index=batch_index)
    except Exception:
        pass


def report_event(name: str, message: str = "", *, step: int | None = None,
                 details: dict[str, Any] | None = None) -> None:
    """Report a worker event (free-form name); never blocks, never raises."""
    with contextlib.suppress(Exception):
        get_reporter().event(name, message, step=step, details=details)

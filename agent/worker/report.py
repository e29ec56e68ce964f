"""Reporting from inside the training loop to the local agent.

A report is one datagram on the agent's Unix socket (``TRAINWARDEN_AGENT_SOCKET``).  The socket
is non-blocking: when the agent is absent, restarting, or its queue is full, the message is
dropped and counted, and training goes on.  Nothing here raises into the training loop.
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import select
import socket
import threading
import time
from collections import deque
from typing import Any

from trainwarden.agent.protocol import (
    ENV_AGENT_SOCKET,
    ENV_ATTEMPT,
    MAX_DATAGRAM_BYTES,
    PROTOCOL_VERSION,
    WorkerEventName,
    encode_datagram,
)


def current_attempt() -> int:
    """The run attempt this process belongs to (set by the agent; 0 without one)."""
    try:
        return int(os.environ.get(ENV_ATTEMPT, "0"))
    except ValueError:
        return 0


class Reporter:
    """Sends worker messages to the agent's datagram socket without ever blocking.

    ``step()`` only appends a tuple to an in-process queue (well under a microsecond); a
    daemon thread formats and sends the queued reports every ``FLUSH_S``.  Waking the agent
    with a syscall from the training thread would cost tens of microseconds on a busy host;
    the sender thread pays it while the training thread is inside torch (which releases the
    GIL).  The queue is bounded: when it is full, reports are dropped and counted.
    """

    def __init__(self, socket_path: str | None = None, *, rank: int | None = None,
                 local_rank: int | None = None, world_size: int | None = None,
                 sender_thread: bool = True) -> None:
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
        self._connected = False
        self._retry_at = 0.0
        self._step_prefix = ""
        self.set_identity(self.rank, self.world_size)
        self._queue: deque[tuple[Any, ...] | bytes] = deque()
        self.max_queue = MAX_QUEUE
        self.sender_thread = sender_thread  # False: the caller flushes (tests)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one drainer at a time keeps the order
        if self.path:
            try:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                self._sock.setblocking(False)
            except OSError:
                self._sock = None

    def set_identity(self, rank: int, world_size: int) -> None:
        """Who this process is (known for sure once the process group is up)."""
        self.rank, self.world_size = rank, world_size
        self._step_prefix = (
            f'{{"type":"step","v":{PROTOCOL_VERSION},"attempt":{self.attempt},'
            f'"rank":{self.rank},"local_rank":{self.local_rank},'
            f'"world_size":{self.world_size},"pid":{self.pid},')

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def _connect(self) -> bool:
        """(Re)connect to the agent's socket; at most one try per RECONNECT_S."""
        now = time.monotonic()
        if now < self._retry_at:
            return False
        self._retry_at = now + RECONNECT_S
        try:
            # (called only while enabled: a socket and its path)
            self._sock.connect(self.path)  # type: ignore[union-attr,arg-type]
        except OSError:
            return False
        self._connected = True
        return True

    def send_bytes(self, data: bytes, wait_s: float = 0.0, count: int = 1) -> bool:
        """Send one encoded message; returns False (and counts a drop) instead of raising.

        ``wait_s``: how long to wait for room when the agent's queue is full (Linux queues
        only ``net.unix.max_dgram_qlen`` = 10 datagrams by default).  Only the sender thread
        and exiting processes wait; the training thread never does."""
        sock = self._sock
        if sock is None or (not self._connected and not self._connect()):
            self.dropped += count
            return False
        deadline = time.monotonic() + wait_s
        while True:
            try:
                sock.send(data)
                break
            except BlockingIOError:  # the agent's queue is full
                left = deadline - time.monotonic()
                if left <= 0:
                    self.dropped += count
                    return False
                try:
                    select.select([], [sock], [], left)
                except (OSError, ValueError):
                    self.dropped += count
                    return False
            except OSError:  # the agent went away (or restarted): reconnect later
                self._connected = False
                self.dropped += count
                return False
        self.sent += count
        return True

    def send(self, message: dict[str, Any]) -> bool:
        try:
            data = encode_datagram(message)
        except Exception:  # an unencodable value: never into training
            self.dropped += 1
            return False
        if len(data) > MAX_DATAGRAM_BYTES:
            self.dropped += 1
            return False
        return self.send_bytes(data)

    def send_blocking(self, message: dict[str, Any], timeout_s: float = 0.5) -> bool:
        """For a process about to exit: wait briefly for queue room instead of dropping."""
        try:
            data = encode_datagram(message)
        except Exception:
            self.dropped += 1
            return False
        self._retry_at = 0.0  # try to connect now, whatever the last attempt was
        return self.send_bytes(data, wait_s=timeout_s)

    def step(self, step: int, *, loss: Any = None, samples: int | None = None,
             tokens: int | None = None, lr: float | None = None, grad_norm: Any = None,
             data_s: float | None = None, compute_s: float | None = None,
             step_s: float | None = None, batch_index: int | None = None) -> bool:
        """Queue one ``StepReport``; returns False when it had to be dropped."""
        if self._sock is None or len(self._queue) >= self.max_queue:
            self.dropped += 1
            return False
        if hasattr(loss, "detach"):  # keep the value, not the autograd graph
            loss = loss.detach()
        self._queue.append((step, time.time(), batch_index, loss, samples, tokens, lr,
                            grad_norm, data_s, compute_s, step_s))
        if self._thread is None and self.sender_thread:
            self._start_sender()
        return True

    def _format_step(self, item: tuple[Any, ...]) -> bytes:
        # Formatted by hand: a few microseconds instead of json.dumps's dozens; same JSON.
        (step, t, batch_index, loss, samples, tokens, lr, grad_norm, data_s, compute_s,
         step_s) = item
        return (self._step_prefix + _STEP_FMT % (
            int(step), t, _int(batch_index), _num(loss), _int(samples), _int(tokens), _num(lr),
            _num(grad_norm), _num(data_s), _num(compute_s), _num(step_s), self.dropped,
        )).encode()

    def _start_sender(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._sender, name="trainwarden-report",
                                                daemon=True)
                self._thread.start()
                atexit.register(self.flush, budget_s=1.0)

    def _sender(self) -> None:
        while True:
            time.sleep(FLUSH_S)
            self.flush()

    def flush(self, budget_s: float | None = None) -> None:
        """Send everything queued, in order, several messages a datagram, waiting for room in
        the agent's queue (at most ``budget_s`` in all, when given).  Never raises."""
        deadline = None if budget_s is None else time.monotonic() + budget_s
        wait = SEND_WAIT_S
        with self._lock:
            q = self._queue
            while q:
                if deadline is not None and time.monotonic() > deadline:
                    self.dropped += len(q)
                    q.clear()
                    return
                lines: list[bytes] = []
                size = 0
                while q and size < BATCH_BYTES:
                    item = q.popleft()
                    try:
                        data = item if isinstance(item, bytes) else self._format_step(item)
                    except Exception:  # an unconvertible value: drop that report only
                        self.dropped += 1
                        continue
                    lines.append(data)
                    size += len(data) + 1
                if not lines:
                    continue
                if not self.send_bytes(b"\n".join(lines), wait_s=wait, count=len(lines)):
                    wait = 0.0  # the agent is not keeping up: don't wait again this round

    def event(self, name: str, message: str = "", *, step: int | None = None,
              details: dict[str, Any] | None = None, blocking: bool = False) -> bool:
        """Send an event after the queued step reports (``blocking``: wait briefly for room,
        for a process about to exit)."""
        msg = {
            "type": "event", "v": PROTOCOL_VERSION, "attempt": self.attempt, "rank": self.rank,
            "local_rank": self.local_rank, "pid": self.pid, "t": time.time(), "name": name,
            "step": step, "message": _CONTROL.sub(_escape, message[:4000]),
            "details": details or {},
        }
        if blocking:
            self.flush(budget_s=0.5)
            return self.send_blocking(msg)
        return self.enqueue(msg)

    def enqueue(self, message: dict[str, Any]) -> bool:
        """Queue a message for the sender thread (after the step reports already queued)."""
        if self._sock is None or len(self._queue) >= self.max_queue:
            self.dropped += 1
            return False
        try:
            data = encode_datagram(message)
        except Exception:
            self.dropped += 1
            return False
        self._queue.append(data)
        if self._thread is None and self.sender_thread:
            self._start_sender()
        return True

    def checkpoint(self, *, step: int, path: str, nbytes: int, save_s: float,
                   async_save: bool, lineage: str, stall_s: float | None = None) -> bool:
        """``stall_s``: how long the save blocked the training loop (None: as ``save_s``
        for a synchronous save; not known for an asynchronous one)."""
        msg = {
            "type": "checkpoint", "v": PROTOCOL_VERSION, "attempt": self.attempt,
            "rank": self.rank, "t": time.time(), "step": step, "path": path, "bytes": nbytes,
            "save_s": save_s, "async_save": async_save, "lineage": lineage,
        }
        if stall_s is not None:
            msg["stall_s"] = stall_s
        return self.enqueue(msg)


MAX_QUEUE = 10_000  # reports waiting for the sender thread; beyond, dropped and counted
FLUSH_S = 0.1  # how often the sender thread sends what is queued (the agent sends every 1 s)
BATCH_BYTES = 16_000  # messages packed into one datagram (well under MAX_DATAGRAM_BYTES)
SEND_WAIT_S = 0.05  # the sender thread waits this long for room in the agent's queue
RECONNECT_S = 1.0  # an absent agent costs one connect attempt a second, not one per step

_STEP_FMT = ('"step":%d,"t":%r,"batch_index":%s,"loss":%s,"samples":%s,"tokens":%s,"lr":%s,'
             '"grad_norm":%s,"data_s":%s,"compute_s":%s,"step_s":%s,"dropped":%d}')


def _num(x: Any) -> str:
    """A JSON number (NaN/Infinity as Python's json writes them) or null."""
    if x is None:
        return "null"
    if hasattr(x, "item"):  # a 0-d tensor; .item() syncs a CUDA tensor, so pass floats on GPU
        x = x.item()
    x = float(x)
    if x != x:
        return "NaN"
    if x in (_INF, -_INF):
        return "Infinity" if x > 0 else "-Infinity"
    return repr(x)


def _int(x: Any) -> str:
    return "null" if x is None else str(int(x))


_INF = float("inf")
# What the supervisor refuses in a message (all C0 controls but tab, newline and carriage
# return; DEL; C1): shown escaped instead, so that a colourised message cannot get its batch
# refused.
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _escape(m: re.Match[str]) -> str:
    return f"\\x{ord(m.group()):02x}"


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

    ``step`` is the 0-based index of the step just trained; ``samples`` and ``tokens`` are
    what *this rank* trained in it (the supervisor sums them over ranks).  Phase times come
    from ``timer`` when given (after its ``stop()``), else from the keyword arguments.  Pass
    ``loss`` as a Python float where you already have one: a CUDA tensor is synchronised by
    ``.item()``.
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


def training_done(step: int | None = None, *, reporter: Reporter | None = None) -> None:
    """Say that this rank's training loop is over: what follows (a final evaluation, the last
    save, shutting the process group down) is teardown, which the hang detectors then judge
    against the finishing allowance instead of the step deadline.  ``Checkpointer.close()``
    calls it; a script without a Checkpointer calls it after its loop.  Never blocks, never
    raises."""
    with contextlib.suppress(Exception):
        (reporter or get_reporter()).event(WorkerEventName.FINISHED, "training loop done",
                                           step=step)


def declare_flops(*, peak_flops_per_rank: float, flops_per_sample: float | None = None,
                  flops_per_token: float | None = None,
                  baseline_per_device: float | None = None) -> None:
    """Declare the model's training FLOPs per sample (or per token) and the peak FLOP/s of
    one rank's accelerator, so the supervisor can show model FLOPs utilisation (MFU):
    throughput x FLOPs per sample / (ranks x peak).  For a dense transformer a common
    estimate is ``6 x parameters`` FLOPs per token (forward and backward).
    ``baseline_per_device`` (optional): the throughput of the same training on one device
    alone, in samples/s (with ``flops_per_sample``) or tokens/s (with ``flops_per_token``),
    for the scaling efficiency: throughput / (ranks x baseline).  Call once after
    ``init_distributed``; bad numbers raise ``ValueError`` here, sending never raises."""
    given = [x for x in (flops_per_sample, flops_per_token) if x is not None]
    if len(given) != 1:
        raise ValueError("declare_flops: pass exactly one of flops_per_sample, flops_per_token")
    checked = [("peak_flops_per_rank", peak_flops_per_rank), ("flops", given[0])]
    if baseline_per_device is not None:
        checked.append(("baseline_per_device", baseline_per_device))
    for name, x in checked:
        if not isinstance(x, int | float) or not math.isfinite(x) or x <= 0:
            raise ValueError(f"declare_flops: {name} must be a positive number, got {x!r}")
    details = {"peak_flops_per_rank": float(peak_flops_per_rank),
               "flops_per_sample": None if flops_per_sample is None else float(flops_per_sample),
               "flops_per_token": None if flops_per_token is None else float(flops_per_token),
               "baseline_per_device": (None if baseline_per_device is None
                                       else float(baseline_per_device))}
    with contextlib.suppress(Exception):
        get_reporter().event(WorkerEventName.FLOPS_DECLARED,
                             "FLOPs per sample/token and peak declared",
                             details=details)

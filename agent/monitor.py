"""Observation only: worker datagrams, worker process stats, disk space, GPU health.  No
decisions here.

torchrun exit detection (exit code, signal, failed ranks from its summary) lives with the
process it observes, in ``launcher.Launcher.poll``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from trainwarden.agent import protocol

log = logging.getLogger(__name__)

# Ask the kernel for a deep receive buffer: between two ticks a fast run sends many datagrams.
# (Linux caps it at net.core.rmem_max; the request is best effort.)
_RCVBUF = 8 * 1024 * 1024
# Per tick at most this many recv calls, so one tick stays short under a flood.
_MAX_RECV_PER_DRAIN = 50_000


class DatagramReceiver:
    """Non-blocking Unix datagram socket with a bounded in-memory queue.

    Invalid datagrams are counted and dropped; when the queue is full the newest datagram is
    dropped and counted (the oldest already waiting are as good as any, and dropping at the
    tail keeps the order of what is kept)."""

    def __init__(self, path: Path, queue_max: int = 100_000) -> None:
        self.path = path
        self.queue: collections.deque[dict[str, Any]] = collections.deque()
        self.queue_max = queue_max
        self.invalid = 0
        self.overflow = 0
        self.received = 0
        self._last_invalid_log = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # a stale socket file of a dead agent
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RCVBUF)
        self.sock.bind(str(path))
        self.sock.setblocking(False)

    def drain(self) -> int:
        """Move what the kernel holds into the queue; returns how many messages were read."""
        n = 0
        for _ in range(_MAX_RECV_PER_DRAIN):
            try:
                data = self.sock.recv(protocol.MAX_DATAGRAM_BYTES + 1024)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                log.warning("agent socket recv failed: %s", e)
                break
            messages, errors = protocol.decode_datagrams(data)
            for err in errors:
                self.invalid += 1
                if self.invalid - self._last_invalid_log >= 100 or self.invalid == 1:
                    self._last_invalid_log = self.invalid
                    log.warning("dropped invalid worker message (%d so far): %s",
                                self.invalid, err)
            for msg in messages:
                try:
                    _check_message(msg)
                except ValueError as e:
                    self.invalid += 1
                    if self.invalid - self._last_invalid_log >= 100 or self.invalid == 1:
                        self._last_invalid_log = self.invalid
                        log.warning("dropped invalid worker message (%d so far): %s",
                                    self.invalid, e)
                    continue
                if len(self.queue) >= self.queue_max:
                    self.overflow += 1
                    if self.overflow == 1 or self.overflow % 1000 == 0:
                        log.warning("worker message queue full: %d message(s) dropped so far",
                                    self.overflow)
                    continue
                self.queue.append(msg)
                self.received += 1
                n += 1
        return n

    def take(self, limit: int | None = None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while self.queue and (limit is None or len(out) < limit):
            out.append(self.queue.popleft())
        return out

    def close(self) -> None:
        self.sock.close()
        with contextlib.suppress(OSError):
            self.path.unlink(missing_ok=True)


def _nonneg_int(msg: dict[str, Any], key: str) -> bool:
    v = msg.get(key)
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_message(msg: dict[str, Any]) -> None:
    """The fields the supervisor requires, checked here: it refuses a whole batch for one bad
    item, and that batch also carries heartbeats and exits from other sources."""
    kind = msg["type"]
    if kind == "step" and not (_nonneg_int(msg, "rank") and _nonneg_int(msg, "step")):
        raise ValueError("step message needs integer rank >= 0 and step >= 0")
    if kind == "checkpoint" and not (
        _nonneg_int(msg, "step") and isinstance(msg.get("path"), str) and msg["path"]
    ):
        raise ValueError("checkpoint message needs integer step >= 0 and a path")
    if kind == "event":
        name = msg.get("name")
        if not isinstance(name, str) or not 0 < len(name) <= 100:
            raise ValueError("event message needs a name of 1 to 100 characters")


class WorkerStats:
    """CPU and memory of the worker processes under torchrun.

    A worker is the topmost descendant carrying a ``RANK`` variable (its data-loader children
    inherit ``RANK`` too; they are not listed as workers).  psutil
    ``Process`` objects are kept between calls because ``cpu_percent`` measures since the
    previous call on the same object."""

    def __init__(self) -> None:
        self._procs: dict[tuple[int, float], psutil.Process] = {}
        self._ranks: dict[tuple[int, float], tuple[int, int] | None] = {}

    def collect(self, root_pid: int | None) -> list[dict[str, Any]]:
        if root_pid is None:
            return []
        try:
            children = psutil.Process(root_pid).children(recursive=True)
        except psutil.Error:
            return []
        out = []
        seen: set[tuple[int, float]] = set()
        ranked_pids: set[int] = set()
        for child in children:  # psutil lists parents before their children
            try:
                key = (child.pid, child.create_time())
            except psutil.Error:
                continue
            seen.add(key)
            proc = self._procs.setdefault(key, child)
            if key not in self._ranks:
                self._ranks[key] = _ranks_of(proc)
            ranks = self._ranks[key]
            if ranks is None:
                continue
            ranked_pids.add(proc.pid)
            try:
                if proc.ppid() in ranked_pids:
                    continue  # a child of a worker (data loader): not a worker itself
                with proc.oneshot():
                    cpu = proc.cpu_percent(interval=None)
                    rss = proc.memory_info().rss
            except psutil.Error:
                continue
            out.append({"rank": ranks[0], "local_rank": ranks[1], "pid": proc.pid,
                        "cpu_percent": cpu, "rss_bytes": rss})
        for key in list(self._procs):
            if key not in seen:
                self._procs.pop(key, None)
                self._ranks.pop(key, None)
        out.sort(key=lambda w: (w["rank"], w["pid"]))
        return out


def _ranks_of(proc: psutil.Process) -> tuple[int, int] | None:
    try:
        env = proc.environ()
        return int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
    except (psutil.Error, OSError, KeyError, ValueError):
        return None


def disk_usage(path: Path | None) -> tuple[int, int] | None:
    """(free, total) bytes of the file system holding ``path`` (its nearest existing parent);
    None when there is no path or it cannot be read."""
    if path is None:
        return None
    p = path
    while not p.exists():
        if p.parent == p:
            return None
        p = p.parent
    try:
        u = shutil.disk_usage(p)
    except OSError:
        return None
    return int(u.free), int(u.total)


# XIDs the application causes (an illegal access, a page fault, a stopped or killed process):
# not the machine's, so not counted as its errors (the supervisor's health ledger reads the
# count as evidence against the node).
APPLICATION_XIDS = frozenset({13, 31, 43, 45})
XID_EVENTS_PER_READ = 256  # drained at most per read (the rest wait for the next)


class GpuHealth:
    """GPU readings through NVML (``nvidia-ml-py``): utilisation, memory, temperature, power,
    uncorrected ECC errors, and where NVML delivers XID events, the hardware XID errors seen
    since the agent started (``xid_errors``, the newest one's code ``xid_last``).  Where NVML
    cannot start (no driver, no GPU: every CPU machine) ``read()`` says "not available" and
    why, once; it never raises.

    ``nvml`` is the module to use (``pynvml``); tests pass a fake."""

    def __init__(self, nvml: Any = None) -> None:
        self._nvml = nvml
        self._handles: list[Any] | None = None
        self._unavailable: str | None = None
        self._events: Any = None  # NVML's event set of XID errors (None: not delivered)
        self._xid_devices: set[int] = set()  # the devices whose XID events are registered
        self._xids: dict[int, int] = {}  # device index -> hardware XID errors seen
        self._xid_last: dict[int, int] = {}

    def _start(self) -> list[Any] | None:
        if self._handles is not None or self._unavailable is not None:
            return self._handles
        try:
            if self._nvml is None:
                import pynvml  # nvidia-ml-py

                self._nvml = pynvml
            self._nvml.nvmlInit()
            count = int(self._nvml.nvmlDeviceGetCount())
            self._handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError...
            self._unavailable = f"{type(e).__name__}: {e}"
            log.info("GPU health not available: %s", self._unavailable)
            return None
        self._register_xids(self._handles)
        return self._handles

    def device_count(self) -> int | None:
        """How many GPUs NVML sees (None where it cannot start: no GPU, no driver)."""
        handles = self._start()
        return None if handles is None else len(handles)

    def _register_xids(self, handles: list[Any]) -> None:
        """Ask NVML for the devices' XID events (where it delivers none, or the bindings
        lack the calls, the readings leave ``xid_errors`` out)."""
        nv = self._nvml
        try:
            events = nv.nvmlEventSetCreate()
        except Exception as e:
            log.info("XID events not available: %s: %s", type(e).__name__, e)
            return
        for i, h in enumerate(handles):
            try:
                nv.nvmlDeviceRegisterEvents(h, nv.nvmlEventTypeXidCriticalError, events)
            except Exception:  # NVMLError_NotSupported on some devices
                continue
            self._xid_devices.add(i)
            self._xids[i] = 0
        self._events = events if self._xid_devices else None

    def _drain_xids(self, handles: list[Any]) -> None:
        """Count the XID events delivered since the last read (never waits)."""
        nv = self._nvml
        if self._events is None:
            return
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        for _ in range(XID_EVENTS_PER_READ):
            try:
                data = wait(self._events, 0)
            except Exception:  # NVMLError_Timeout: nothing more now
                return
            index = next((i for i, h in enumerate(handles) if h == data.device), None)
            xid = int(data.eventData)
            if index is None or xid in APPLICATION_XIDS:
                continue
            self._xids[index] = self._xids.get(index, 0) + 1
            self._xid_last[index] = xid

    def read(self) -> dict[str, Any]:
        """``{"available": True, "devices": [...]}`` or ``{"available": False, "reason"}``."""
        handles = self._start()
        if handles is None:
            return {"available": False, "reason": self._unavailable or "unknown"}
        self._drain_xids(handles)
        devices = [self._device(i, h) for i, h in enumerate(handles)]
        for i, d in enumerate(devices):
            if i in self._xid_devices:
                d["xid_errors"] = self._xids.get(i, 0)
                d["xid_last"] = self._xid_last.get(i)
        return {"available": True, "devices": devices}

    def uuid(self, index: int) -> str | None:
        """NVML's UUID of device ``index`` (``GPU-...``), by which a CUDA device is matched to
        its readings: NVML counts every GPU of the machine in its own order, CUDA only the
        visible ones.  None where NVML or that reading is not available."""
        handles = self._start()
        if handles is None or not 0 <= index < len(handles):
            return None
        try:
            u = self._nvml.nvmlDeviceGetUUID(handles[index])
        except Exception:
            return None
        return u.decode() if isinstance(u, bytes) else str(u)

    def _device(self, index: int, h: Any) -> dict[str, Any]:
        nv = self._nvml

        def get(fn: Callable[[], Any]) -> Any:
            try:
                return fn()
            except Exception:  # NVMLError_NotSupported and friends: that reading is absent
                return None

        name = get(lambda: nv.nvmlDeviceGetName(h))
        mem = get(lambda: nv.nvmlDeviceGetMemoryInfo(h))
        util = get(lambda: nv.nvmlDeviceGetUtilizationRates(h))
        power_mw = get(lambda: nv.nvmlDeviceGetPowerUsage(h))
        return {
            "index": index,
            "name": name.decode() if isinstance(name, bytes) else name,
            "util_percent": None if util is None else int(util.gpu),
            "mem_used_bytes": None if mem is None else int(mem.used),
            "mem_total_bytes": None if mem is None else int(mem.total),
            "temp_c": get(lambda: int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))),
            "power_w": None if power_mw is None else round(power_mw / 1000.0, 1),
            "ecc_uncorrected": get(lambda: int(nv.nvmlDeviceGetTotalEccErrors(
                h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))),
        }


def hostname() -> str:
    return os.uname().nodename

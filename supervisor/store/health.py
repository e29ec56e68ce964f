"""The node-health JSON an agent's heartbeat carries (its workers' CPU and memory, its GPU
readings), reduced to the shape every reader expects: known keys, finite numbers, text where
text belongs.  Applied where the rows are written and again where they are read, so a row
stored by an older version (or by hand) renders like any other."""

from __future__ import annotations

import math
from typing import Any

from trainwarden.agent.core import text as untrusted

WORKER_KEYS = ("rank", "local_rank", "pid", "cpu_percent", "rss_bytes")
# (xid_errors: the hardware XID errors the agent counted, xid_last the newest one's code:
# evidence for the health ledger, ``detect.node_health.gpu_evidence``)
GPU_NUMBERS = ("util_percent", "mem_used_bytes", "mem_total_bytes", "temp_c", "power_w",
               "ecc_uncorrected", "xid_errors", "xid_last")
MAX_DEVICES = 64
MAX_TEXT = 500


INT64_MAX = 2**63 - 1  # (a JSON integer may be any size; readers take floats of them)


def number(x: Any) -> int | float | None:
    """``x`` if it is a finite number (not a bool) a 64-bit column could hold, else None."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    if isinstance(x, int):
        return x if -INT64_MAX - 1 <= x <= INT64_MAX else None
    return x if math.isfinite(x) else None


def workers_total(workers: list[dict[str, Any]] | None, key: str) -> float | None:
    """The sum of one reading over a node's workers (their CPU percent, their RSS bytes), as
    every page and ``/metrics`` show it; None when no worker has it, or when the sum is not
    a finite number (each value is finite, but two of 1e308 add up to infinity)."""
    values = [float(w[key]) for w in workers or () if number(w.get(key)) is not None]
    if not values:
        return None
    total = sum(values)  # (overflows to infinity, where math.fsum raises)
    return total if math.isfinite(total) else None


def worker_stats(workers: Any) -> list[dict[str, Any]]:
    """The workers list as stored: dicts of the known keys with finite numbers only."""
    if not isinstance(workers, list):
        return []
    out = []
    isfinite = math.isfinite
    for w in workers:  # (in every heartbeat: the plain int and float take the short branch)
        if not isinstance(w, dict):
            continue
        kept: dict[str, Any] = {}
        for k in WORKER_KEYS:
            v = w.get(k)
            if not ((type(v) is int and -INT64_MAX - 1 <= v <= INT64_MAX)
                    or (type(v) is float and isfinite(v))):
                v = None if v is None else number(v)
            if v is not None:
                kept[k] = v
        out.append(kept)
    return out


def gpu_health(gpus: Any) -> dict[str, Any] | None:
    """``{"available": bool, "reason": str, "devices": [...]}`` with the keys the reading
    has, each of its type (a key of the wrong type is left out); None: not a reading."""
    if not isinstance(gpus, dict):
        return None
    out: dict[str, Any] = {"available": gpus.get("available") is True}
    if "reason" in gpus:
        out["reason"] = _text(gpus["reason"])
    devices = gpus.get("devices")
    if devices is None:
        return out
    out["devices"] = []
    for d in devices[:MAX_DEVICES] if isinstance(devices, list) else []:
        if not isinstance(d, dict):
            continue
        dev: dict[str, Any] = {}
        index = d.get("index")
        if isinstance(index, int) and not isinstance(index, bool):
            dev["index"] = index
        elif index is not None:
            dev["index"] = _text(index)
        if "name" in d:
            dev["name"] = None if d["name"] is None else _text(d["name"])
        for k in GPU_NUMBERS:
            if k in d:
                dev[k] = number(d[k])  # (None: not read, or not a number)
        out["devices"].append(dev)
    return out


def _text(x: Any) -> str:
    return "" if x is None else untrusted.clean(str(x), MAX_TEXT, multiline=False)

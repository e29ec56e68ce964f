"""Preflight: a short health check each worker runs once its process group is up, before its
first step, so that a bad member is found (and its node replaced) before the attempt counts
as running instead of after it has failed mid-run.

``init_distributed`` runs ``preflight_at_start`` once per process and reports the result as a
``preflight`` worker event; a failed check raises ``PreflightFailed``, so the worker exits
non-zero before its first step.  Three checks, in this order, each timed with
``time.monotonic``; every rank runs all three whatever the first ones said, so that the
collective is entered by every rank and a failure is charged to the rank that has it:

- ``devices``: where CUDA is available, this rank's device ``cuda:LOCAL_RANK`` exists, and
  NVML's readings of it show no uncorrected ECC errors (NVML not available is said, not
  failed); on a machine without CUDA, skipped.
- ``compute``: a fixed 256x256 float32 matmul (inputs from a seeded generator) on that device
  (else the CPU), compared with the float64 product on the CPU: its largest error, relative to
  the largest entry, must be within the tolerance (which TF32 stays well inside).
- ``allreduce``: every rank contributes ``rank + 1`` and every element of the sum must be
  ``world * (world + 1) / 2``; done twice (the first meets every rank and sets up the
  communicator, the second is the fabric alone), both within ``timeout_s`` of the check's
  start, or the check fails with the time it waited against that bound.

Turned off by ``TRAINWARDEN_PREFLIGHT=0``; ``TRAINWARDEN_PREFLIGHT_TIMEOUT_S`` sets the bound
(the agent sets both from its ``preflight`` and ``preflight_timeout_s`` options).

Test aid: ``TRAINWARDEN_PREFLIGHT_INJECT`` in a process's environment makes one check fail in
that process only (per process, so one node's agent started with it fails only that node):

- ``fail`` or ``fail:compute``: the device's matmul result gets one wrong entry;
- ``fail:devices``: the devices check fails as if the device reported an error;
- ``fail:allreduce``: the sum this process received gets one wrong element (the collective
  itself is the real one, so the other ranks pass);
- ``slow:allreduce``: this process waits past the bound inside its timed all-reduce, after
  the collectives (so again only this process fails).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainwarden.agent.protocol import (
    ENV_NODE,
    ENV_PREFLIGHT,
    ENV_PREFLIGHT_TIMEOUT,
    PREFLIGHT_TIMEOUT_S,
    WorkerEventName,
)
from trainwarden.agent.worker.report import Reporter, get_reporter

ENV_PREFLIGHT_INJECT = "TRAINWARDEN_PREFLIGHT_INJECT"
INJECTIONS = ("fail", "fail:compute", "fail:devices", "fail:allreduce", "slow:allreduce")

MATMUL_SIZE = 256
MATMUL_SEED = 20261205
# The matmul's largest error relative to the largest entry of the product.  Healthy float32
# is near 1e-7 and TF32 (10-bit mantissa, if the script enabled it) near 1e-3 of it; a
# faulty unit gives a wrong or non-finite entry, far outside.
MATMUL_TOLERANCE = 1e-2
# Elements of the all-reduced tensor (float64: the expected sum is exact for any world size).
ALLREDUCE_NUMEL = 1 << 17  # 1 MiB
# The process group's own timeout while the preflight's collectives are in flight: a little
# past our bound, so that our wait ends first (with its message) and a collective a missing
# peer never joins is then failed by the backend instead of holding the exit of this process
# for the group's full timeout (gloo waits on it when the process group is torn down).
BACKEND_GRACE_S = 2.0
_POLL_MAX_S = 0.005


class PreflightFailed(RuntimeError):
    """A preflight check failed: this worker must not start training."""

    def __init__(self, result: PreflightResult) -> None:
        super().__init__(f"preflight failed: {result.failed}")
        self.result = result


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    seconds: float
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "seconds": round(self.seconds, 6),
                "detail": self.detail}


@dataclass(frozen=True)
class PreflightResult:
    passed: bool
    checks: tuple[Check, ...]
    seconds: float
    failed: str | None  # "<check>: <detail>" of each failed check, one line

    def details(self) -> dict[str, Any]:
        """The ``preflight`` event's details (without node and hostname)."""
        return {"passed": self.passed, "checks": [c.as_dict() for c in self.checks],
                "seconds": round(self.seconds, 6), "failed": self.failed}


@dataclass(frozen=True)
class Injection:
    kind: str  # "fail" or "slow"
    check: str  # "compute", "devices" or "allreduce"

    def hits(self, kind: str, check: str) -> bool:
        return (self.kind, self.check) == (kind, check)


def parse_injection(value: str | None) -> Injection | None:
    """``TRAINWARDEN_PREFLIGHT_INJECT``'s value; ``ValueError`` names the accepted ones."""
    if not value:
        return None
    if value not in INJECTIONS:
        raise ValueError(f"{ENV_PREFLIGHT_INJECT}={value!r}: use one of {', '.join(INJECTIONS)}")
    kind, _, check = value.partition(":")
    return Injection(kind, check or "compute")


@dataclass(frozen=True)
class PreflightSettings:
    enabled: bool = True
    timeout_s: float = PREFLIGHT_TIMEOUT_S
    inject: Injection | None = None


def settings_from_env(environ: Mapping[str, str] | None = None) -> PreflightSettings:
    """The preflight as this process's environment asks for it; ``ValueError`` for a value
    that says nothing clear (a typo must not turn the check off or on by accident)."""
    env = os.environ if environ is None else environ
    flag = env.get(ENV_PREFLIGHT, "1").strip().lower()
    if flag not in ("0", "1", "false", "true", "no", "yes", "off", "on", ""):
        raise ValueError(f"{ENV_PREFLIGHT}={flag!r}: use 1 (run the check) or 0 (skip it)")
    raw = env.get(ENV_PREFLIGHT_TIMEOUT, "").strip()
    try:
        timeout_s = float(raw) if raw else PREFLIGHT_TIMEOUT_S
    except ValueError:
        timeout_s = float("nan")
    if not timeout_s > 0 or timeout_s == float("inf"):
        raise ValueError(f"{ENV_PREFLIGHT_TIMEOUT}={raw!r}: use a number of seconds > 0")
    return PreflightSettings(enabled=flag not in ("0", "false", "no", "off"),
                             timeout_s=timeout_s,
                             inject=parse_injection(env.get(ENV_PREFLIGHT_INJECT, "").strip()))


# -- the checks -------------------------------------------------------------------------------


def rank_device(local_rank: int) -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` where CUDA is available."""
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")


def check_devices(device: torch.device, *, gpus: Any = None, inject: Injection | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Check:
    """This rank's device is there and NVML reports no uncorrected ECC error on it.
    ``gpus``: a ``GpuHealth`` (tests pass one with a fake NVML); by default the real one."""
    t0 = clock()
    if inject is not None and inject.hits("fail", "devices"):
        return Check("devices", False, clock() - t0,
                     f"{device}: failure injected ({ENV_PREFLIGHT_INJECT})")
    if device.type != "cuda":
        return Check("devices", True, clock() - t0, "no GPU: skipped")
    index = device.index or 0
    count = torch.cuda.device_count()
    if index >= count:
        return Check("devices", False, clock() - t0,
                     f"LOCAL_RANK {index} but {count} CUDA device(s) visible")
    if gpus is None:
        from trainwarden.agent.monitor import GpuHealth  # NVML only where there is a GPU

        gpus = GpuHealth()
    uuid: str | None = None
    with contextlib.suppress(Exception):  # an older torch without the property
        uuid = str(torch.cuda.get_device_properties(index).uuid)
    passed, detail = judge_gpu_readings(index, count, uuid, gpus)
    return Check("devices", passed, clock() - t0, detail)


def _same_uuid(a: str | None, b: str | None) -> bool:
    # NVML writes "GPU-<uuid>", torch the bare uuid.
    def norm(u: str) -> str:
        u = u.strip().lower()
        return u[4:] if u.startswith("gpu-") else u

    return a is not None and b is not None and norm(a) == norm(b)


def judge_gpu_readings(index: int, count: int, uuid: str | None, gpus: Any) -> tuple[bool, str]:
    """(passed, detail) for ``cuda:index`` from a ``GpuHealth``'s readings.  NVML not
    available passes (said so): a machine without it is not a faulty machine.  Where the
    CUDA device cannot be matched to an NVML device (no UUID), every device NVML sees is
    judged: an ECC error anywhere on the node fails the node."""
    present = f"cuda:{index} present ({count} visible)"
    reading = gpus.read()
    if not reading.get("available"):
        return True, f"{present}; NVML not available: {reading.get('reason', 'unknown')}"
    devices = list(reading.get("devices") or [])
    mine = [d for d in devices if _same_uuid(gpus.uuid(d.get("index", -1)), uuid)]
    judged = mine or devices
    bad = [d for d in judged if (d.get("ecc_uncorrected") or 0) > 0]
    if bad:
        return False, "; ".join(
            f"GPU {d.get('index')} ({d.get('name')}): {d['ecc_uncorrected']} uncorrected "
            "ECC error(s)" for d in bad)
    which = (f"NVML device {mine[0].get('index')}" if mine
             else f"all {len(devices)} NVML device(s), cuda:{index} not matched to one")
    return True, f"{present}; {which}: no uncorrected ECC errors"


def check_compute(device: torch.device, *, size: int = MATMUL_SIZE,
                  tolerance: float = MATMUL_TOLERANCE, inject: Injection | None = None,
                  clock: Callable[[], float] = time.monotonic) -> Check:
    """A fixed float32 matmul on ``device`` against the float64 product on the CPU."""
    t0 = clock()
    gen = torch.Generator().manual_seed(MATMUL_SEED)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    what = f"{size}x{size} float32 matmul on {device}"
    try:
        out = a.to(device) @ b.to(device)
        if inject is not None and inject.hits("fail", "compute"):
            out[0, 0] += 1e3  # a wrong entry, as a faulty unit would write it
        got = out.to("cpu", torch.float64)  # waits for the device
    except Exception as e:  # a CUDA error is this check's answer, not a crash
        return Check("compute", False, clock() - t0,
                     f"{what} raised {type(e).__name__}: {_first_line(e)}")
    ref = a.double() @ b.double()
    error = float(((got - ref).abs().max() / ref.abs().max()).item())
    passed = error <= tolerance  # NaN fails
    return Check("compute", passed, clock() - t0,
                 f"{what}: largest error {error:.1e} of the largest entry "
                 f"({'within' if passed else 'outside'} tolerance {tolerance:g})")


def _first_line(e: BaseException) -> str:
    # The result's ``failed`` is one line; CUDA's and gloo's messages run on for several.
    lines = str(e).strip().splitlines()
    return lines[0] if lines else ""


def _collective_device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _set_group_timeout(timeout: timedelta, group: dist.ProcessGroup | None) -> bool:
    """Set the group's collective timeout; False where this torch or backend cannot."""
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._set_pg_timeout(timeout, group)
    except Exception:  # no such function, or a backend it does not handle
        return False
    return True


def _wait(work: Any, deadline: float, clock: Callable[[], float]) -> bool:
    """Wait for an async collective until ``deadline``: True when it completed.  Polled:
    NCCL's ``wait()`` does not block the CPU, and gloo's cannot be given our bound."""
    pause = 0.0002
    while not work.is_completed():
        left = deadline - clock()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, _POLL_MAX_S)
    return True


def check_allreduce(*, timeout_s: float, group: dist.ProcessGroup | None = None,
                    group_timeout: timedelta | None = None, numel: int = ALLREDUCE_NUMEL,
                    inject: Injection | None = None,
                    clock: Callable[[], float] = time.monotonic) -> Check:
    """Two all-reduces of ``rank + 1`` across ``group`` (default: the default group), both
    within ``timeout_s``; every element of each sum must be ``world * (world + 1) / 2``.

    ``group_timeout``: the group's own timeout; given, the group's timeout is shortened to a
    little past the bound while the collectives are in flight and set back to it after."""
    t0 = clock()
    deadline = t0 + timeout_s
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    expected = world * (world + 1) / 2
    device = _collective_device(group)
    shortened = group_timeout is not None and _set_group_timeout(
        timedelta(seconds=timeout_s + BACKEND_GRACE_S), group)
    times: list[float] = []
    wrong_sum: str | None = None
    try:
        # Both collectives are entered whatever the first one's sum was: a rank that left
        # early would leave the others waiting on it, and fail them instead of itself.
        for _ in range(2):
            t = torch.full((numel,), float(rank + 1), dtype=torch.float64, device=device)
            start = clock()
            work = dist.all_reduce(t, group=group, async_op=True)
            if not _wait(work, deadline, clock):
                waited = clock() - t0
                return Check("allreduce", False, waited,
                             f"all-reduce {len(times) + 1} of 2 across {world} ranks not done "
                             f"after {waited:.2f} s (bound {timeout_s:g} s): a rank that never "
                             "joined, or a slow fabric")
            work.wait()  # raises the collective's own error, if it failed
            times.append(clock() - start)
            got = t.cpu()
            if inject is not None and inject.hits("fail", "allreduce"):
                got[-1] += 1.0  # as if what this process received were damaged
            wrong = got != expected
            if wrong_sum is None and bool(wrong.any()):
                value = float(got[wrong.nonzero()[0, 0]].item())
                wrong_sum = (f"sum across {world} ranks is {value:g} on "
                             f"{int(wrong.sum().item())} of {numel} elements, expected "
                             f"{expected:g}")
        if inject is not None and inject.hits("slow", "allreduce"):
            time.sleep(max(0.0, deadline - clock()) + 0.05)
        took = clock() - t0
    except Exception as e:  # the backend's error (a peer gone, its own timeout)
        return Check("allreduce", False, clock() - t0,
                     f"all-reduce across {world} ranks raised {type(e).__name__}: "
                     f"{_first_line(e)}")
    finally:
        if shortened:
            # A collective still in flight keeps the short timeout it was started with.
            _set_group_timeout(group_timeout, group)  # type: ignore[arg-type]
    if wrong_sum is not None:
        return Check("allreduce", False, took, wrong_sum)
    first, second = times
    parts = f"(first {first:.3f} s, then {second:.3f} s)"
    if took > timeout_s:
        return Check("allreduce", False, took,
                     f"took {took:.3f} s {parts}, over the bound of {timeout_s:g} s "
                     f"(sum {expected:g} across {world} ranks as expected)")
    return Check("allreduce", True, took,
                 f"sum {expected:g} across {world} ranks as expected in {took:.3f} s {parts}, "
                 f"bound {timeout_s:g} s")


def run_preflight(*, local_rank: int, timeout_s: float = PREFLIGHT_TIMEOUT_S,
                  group: dist.ProcessGroup | None = None,
                  group_timeout: timedelta | None = None, device: torch.device | None = None,
                  inject: Injection | None = None, gpus: Any = None,
                  clock: Callable[[], float] = time.monotonic) -> PreflightResult:
    """Every check, in order, on this rank (the process group must be up: the all-reduce is
    collective, so every rank of ``group`` must call this).  Never raises for a failed check:
    the result says which failed and why."""
    t0 = clock()
    device = device if device is not None else rank_device(local_rank)
    checks = (
        check_devices(device, gpus=gpus, inject=inject, clock=clock),
        check_compute(device, inject=inject, clock=clock),
        check_allreduce(timeout_s=timeout_s, group=group, group_timeout=group_timeout,
                        inject=inject, clock=clock),
    )
    failed = [c for c in checks if not c.passed]
    return PreflightResult(
        passed=not failed, checks=checks, seconds=clock() - t0,
        failed="; ".join(f"{c.name}: {c.detail}" for c in failed) or None)


def report_preflight(result: PreflightResult, reporter: Reporter | None = None) -> None:
    """Send the ``preflight`` event (waiting briefly for room when it failed: the process is
    about to exit).  Never raises."""
    with contextlib.suppress(Exception):
        details = {**result.details(), "node": os.environ.get(ENV_NODE),
                   "hostname": socket.gethostname()}
        message = (f"preflight passed in {result.seconds:.3f} s" if result.passed
                   else f"preflight failed: {result.failed}")
        (reporter or get_reporter()).event(WorkerEventName.PREFLIGHT, message, details=details,
                                           blocking=not result.passed)


def preflight_at_start(*, local_rank: int, group_timeout: timedelta | None = None,
                       environ: Mapping[str, str] | None = None,
                       reporter: Reporter | None = None) -> PreflightResult | None:
    """What ``init_distributed`` runs once the default process group is up: the preflight as
    the environment asks for it (None: turned off), reported; ``PreflightFailed`` when a
    check failed."""
    settings = settings_from_env(environ)
    if not settings.enabled:
        # Said all the same: the restart's anatomy then shows a preflight phase of 0 s
        # rather than an unknown one (the ledger reads no pass or failure from it).
        with contextlib.suppress(Exception):
            (reporter or get_reporter()).event(
                WorkerEventName.PREFLIGHT, "preflight turned off",
                details={"passed": None, "skipped": True, "seconds": 0.0,
                         "node": os.environ.get(ENV_NODE), "hostname": socket.gethostname()})
        return None
    result = run_preflight(local_rank=local_rank, timeout_s=settings.timeout_s,
                           group_timeout=group_timeout, inject=settings.inject)
    report_preflight(result, reporter)
    if not result.passed:
        raise PreflightFailed(result)
    return result

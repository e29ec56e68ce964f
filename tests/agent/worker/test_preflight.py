"""The preflight's checks on this CPU machine, in a one-process gloo group: a healthy worker
passes every one; a corrupted matmul, a tolerance it cannot meet, a wrong sum, a slow and a
never-finishing all-reduce each fail with their numbers; GPU readings judged from a fake
NVML.  The real two-worker torchrun is tests/e2e/test_preflight.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch

from tests.agent.test_agent_units import FakeNvml
from tests.waiting import wait_for
from tests.wire import Receiver
from trainwarden.agent.core import rootcause
from trainwarden.agent.monitor import GpuHealth
from trainwarden.agent.protocol import PREFLIGHT_TIMEOUT_S, WorkerEventName
from trainwarden.agent.worker import preflight as pf
from trainwarden.agent.worker.distributed import classify_exception
from trainwarden.agent.worker.report import Reporter
from trainwarden.supervisor.detect import node_health

CPU = torch.device("cpu")


def test_settings_from_the_environment() -> None:
    assert pf.settings_from_env({}) == pf.PreflightSettings(True, PREFLIGHT_TIMEOUT_S, None)
    assert not pf.settings_from_env({"TRAINWARDEN_PREFLIGHT": "0"}).enabled
    assert pf.settings_from_env({"TRAINWARDEN_PREFLIGHT": "1",
                                 "TRAINWARDEN_PREFLIGHT_TIMEOUT_S": "2.5"}).timeout_s == 2.5
    assert pf.settings_from_env({"TRAINWARDEN_PREFLIGHT_INJECT": "fail"}).inject == \
        pf.Injection("fail", "compute")
    assert pf.settings_from_env({"TRAINWARDEN_PREFLIGHT_INJECT": "slow:allreduce"}).inject == \
        pf.Injection("slow", "allreduce")
    for env, says in [({"TRAINWARDEN_PREFLIGHT": "maybe"}, "use 1"),
                      ({"TRAINWARDEN_PREFLIGHT_TIMEOUT_S": "-1"}, "> 0"),
                      ({"TRAINWARDEN_PREFLIGHT_TIMEOUT_S": "nan"}, "> 0"),
                      ({"TRAINWARDEN_PREFLIGHT_INJECT": "fail:disk"}, "fail:compute")]:
        with pytest.raises(ValueError, match=says):
            pf.settings_from_env(env)


def test_a_healthy_cpu_worker_passes_every_check(world1: None) -> None:
    result = pf.run_preflight(local_rank=0)
    assert result.passed and result.failed is None, result
    assert [c.name for c in result.checks] == ["devices", "compute", "allreduce"]
    assert all(c.passed and c.seconds >= 0 for c in result.checks)
    assert result.seconds >= sum(c.seconds for c in result.checks)
    assert result.seconds < 1.0
    devices, compute, allreduce = result.checks
    assert devices.detail == "no GPU: skipped"
    assert compute.detail.startswith("256x256 float32 matmul on cpu: largest error ")
    assert "within tolerance 0.01" in compute.detail
    assert allreduce.detail.startswith("sum 1 across 1 ranks as expected in ")
    assert result.details()["checks"][1] == {"name": "compute", "passed": True,
                                             "seconds": round(compute.seconds, 6),
                                             "detail": compute.detail}


def test_a_matmul_outside_the_tolerance_fails_with_its_error() -> None:
    # float32 against the float64 product is off by about 1e-7 of the largest entry: a
    # tolerance of 1e-12 cannot be met by a correct result.
    check = pf.check_compute(CPU, tolerance=1e-12)
    assert not check.passed
    error = float(check.detail.split("largest error ")[1].split()[0])
    assert 1e-12 < error < 1e-5, check.detail
    assert check.detail.endswith("of the largest entry (outside tolerance 1e-12)")


def test_a_corrupted_matmul_result_fails_the_compute_check() -> None:
    check = pf.check_compute(CPU, inject=pf.Injection("fail", "compute"))
    assert not check.passed
    error = float(check.detail.split("largest error ")[1].split()[0])
    assert error > 1.0, check.detail  # one entry off by 1000 against entries below 100


class NeverDone:
    """An all-reduce whose peer never arrives."""

    def is_completed(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("never waited on without a bound")


def _group_timeout() -> timedelta:
    from torch.distributed import distributed_c10d

    backend = distributed_c10d._get_default_group()._get_backend(CPU)
    return backend.options._timeout  # type: ignore[attr-defined,no-any-return]


def test_an_all_reduce_that_never_finishes_fails_at_the_bound(
        world1: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[timedelta] = []

    def all_reduce(t: torch.Tensor, **kw: Any) -> NeverDone:
        seen.append(_group_timeout())
        return NeverDone()

    original = _group_timeout()
    monkeypatch.setattr(pf.dist, "all_reduce", all_reduce)
    check = pf.check_allreduce(timeout_s=0.3, group_timeout=original)
    assert not check.passed and 0.3 <= check.seconds < 1.5, check
    assert check.detail.startswith("all-reduce 1 of 2 across 1 ranks not done after 0.3")
    assert check.detail.endswith("s (bound 0.3 s): a rank that never joined, or a slow fabric")
    # While in flight the group's own timeout was a little past the bound, then set back.
    assert seen == [timedelta(seconds=0.3 + pf.BACKEND_GRACE_S)]
    assert _group_timeout() == original


def test_a_slow_all_reduce_fails_with_its_time_against_the_bound(world1: None) -> None:
    check = pf.check_allreduce(timeout_s=0.2, inject=pf.Injection("slow", "allreduce"))
    assert not check.passed and check.seconds > 0.2
    took = float(check.detail.split("took ")[1].split()[0])
    assert took > 0.2 and check.detail.split(")")[1].startswith(", over the bound of 0.2 s")
    assert check.detail.endswith("(sum 1 across 1 ranks as expected)")


def test_a_wrong_sum_fails_the_all_reduce_check(world1: None) -> None:
    check = pf.check_allreduce(timeout_s=5.0, numel=1000,
                               inject=pf.Injection("fail", "allreduce"))
    assert not check.passed
    assert check.detail == "sum across 1 ranks is 2 on 1 of 1000 elements, expected 1"


class FakeGpus:
    """What judge_gpu_readings asks of a GpuHealth, with uuids for the fake NVML's two GPUs."""

    def __init__(self, health: GpuHealth) -> None:
        self.health = health

    def read(self) -> dict[str, Any]:
        return self.health.read()

    def uuid(self, index: int) -> str | None:
        return f"GPU-0000000{index}-aaaa-bbbb-cccc-dddddddddddd"


def test_gpu_readings_judge_this_ranks_device() -> None:
    gpus = FakeGpus(GpuHealth(FakeNvml()))  # device 1 has 4 uncorrected ECC errors
    ok, detail = pf.judge_gpu_readings(0, 2, "00000000-aaaa-bbbb-cccc-dddddddddddd", gpus)
    assert ok and detail == ("cuda:0 present (2 visible); NVML device 0: no uncorrected ECC "
                             "errors")
    ok, detail = pf.judge_gpu_readings(1, 2, "00000001-AAAA-bbbb-cccc-dddddddddddd", gpus)
    assert not ok and detail == "GPU 1 (NVIDIA H200): 4 uncorrected ECC error(s)"
    # Not matched to an NVML device: every device is judged, the node fails.
    ok, detail = pf.judge_gpu_readings(0, 2, None, gpus)
    assert not ok and detail == "GPU 1 (NVIDIA H200): 4 uncorrected ECC error(s)"
    # NVML not available is said, not failed.
    ok, detail = pf.judge_gpu_readings(
        0, 1, None, GpuHealth(FakeNvml(fail_init=RuntimeError("driver not loaded"))))
    assert ok and detail == ("cuda:0 present (1 visible); NVML not available: RuntimeError: "
                             "driver not loaded")


def test_the_devices_check_on_a_machine_without_cuda() -> None:
    skipped = pf.check_devices(CPU)
    assert (skipped.name, skipped.passed, skipped.detail) == ("devices", True, "no GPU: skipped")
    failed = pf.check_devices(CPU, inject=pf.Injection("fail", "devices"))
    assert not failed.passed and "failure injected" in failed.detail


def test_preflight_at_start_reports_its_event_and_raises_when_a_check_fails(
        world1: None, receiver: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWARDEN_NODE", "node7")
    reporter = Reporter(receiver.path, rank=0, local_rank=0, world_size=1,
                        sender_thread=False)
    result = pf.preflight_at_start(local_rank=0, environ={}, reporter=reporter)
    assert result is not None and result.passed
    reporter.flush()
    [ev] = wait_for(lambda: receiver.of("event", WorkerEventName.PREFLIGHT), what="the event")
    assert ev["message"] == f"preflight passed in {result.seconds:.3f} s"
    d = ev["details"]
    assert set(d) == {"passed", "checks", "seconds", "failed", "node", "hostname"}
    assert d["passed"] is True and d["failed"] is None and d["node"] == "node7"
    assert d["seconds"] == round(result.seconds, 6) and d["hostname"]
    assert [c["name"] for c in d["checks"]] == ["devices", "compute", "allreduce"]

    with pytest.raises(pf.PreflightFailed, match=r"^preflight failed: compute: 256x256 ") as e:
        pf.preflight_at_start(local_rank=0, environ={"TRAINWARDEN_PREFLIGHT_INJECT": "fail"},
                              reporter=reporter)
    failed = wait_for(lambda: receiver.of("event", WorkerEventName.PREFLIGHT)[1:],
                      what="the failed preflight's event")[0]  # sent at once: blocking
    assert failed["details"]["passed"] is False
    assert failed["details"]["failed"] == e.value.result.failed
    assert failed["details"]["failed"].startswith("compute: ")
    assert [c["passed"] for c in failed["details"]["checks"]] == [True, False, True]

    assert pf.preflight_at_start(local_rank=0, environ={"TRAINWARDEN_PREFLIGHT": "0"},
                                 reporter=reporter) is None
    # Turned off, it still says so: the restart's preflight phase is then 0 s, not unknown,
    # and the event carries no verdict for the host's ledger.
    reporter.flush()
    off = wait_for(lambda: receiver.of("event", WorkerEventName.PREFLIGHT)[2:],
                   what="the turned-off preflight's event")[0]
    assert off["message"] == "preflight turned off"
    assert off["details"]["passed"] is None and off["details"]["skipped"] is True
    assert node_health.preflight_result(off["details"]) is None


def test_a_preflight_failure_is_the_machines_not_a_collective_timeout() -> None:
    result = pf.PreflightResult(False, (), 4.1, "allreduce: all-reduce 1 of 2 across 2 ranks "
                                                 "not done after 4.00 s (bound 4 s)")
    exc = pf.PreflightFailed(result)
    assert classify_exception(exc) == (WorkerEventName.EXCEPTION, "unknown")
    rc = rootcause.RootCause(
        exc_type="trainwarden.agent.worker.preflight.PreflightFailed", message=str(exc),
        frame=rootcause.Frame("/x/trainwarden/agent/worker/preflight.py", 1, "f"),
        user_frame=rootcause.Frame("/home/u/train.py", 40, "main"), traceback="",
        source="stderr", rank=1, host=None)
    # The script's frame is in its traceback, yet a retry on another node may pass.
    assert rootcause.classify(rc) == rootcause.FailureClass.MACHINE
    assert rootcause.fingerprint(rc) is None


def test_a_device_error_fails_the_compute_check_on_one_line(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(self: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        raise RuntimeError("CUDA error: an illegal memory access was encountered\n"
                           "CUDA kernel errors might be asynchronously reported")

    monkeypatch.setattr(torch.Tensor, "to", broken)
    check = pf.check_compute(torch.device("cuda", 1))
    assert not check.passed
    assert check.detail == ("256x256 float32 matmul on cuda:1 raised RuntimeError: CUDA error: "
                            "an illegal memory access was encountered")

"""Unit tests of the agent pieces that need no child processes."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from agent_fakes import FakeSupervisor

from trainwarden.agent import protocol
from trainwarden.agent.config import AgentConfig
from trainwarden.agent.deadletter import DeadLetters
from trainwarden.agent.executor import Executor
from trainwarden.agent.launcher import parse_failure_summary
from trainwarden.agent.monitor import DatagramReceiver, GpuHealth, disk_usage
from trainwarden.agent.spool import Spool
from trainwarden.agent.uplink import Uplink

# torch 2.13's ChildFailedError text for two failed ranks, one with a Python traceback.
SUMMARY = """
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-01-01_00:00:01
  host      : node
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 1001)
  error_file: /tmp/x/error.json
  traceback : Traceback (most recent call last):
    File "train.py", line 3, in <module>
      main()
  RuntimeError: Connection reset by peer
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : node
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 1002)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 1002
============================================================
"""


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# -- launcher: failure summary -------------------------------------------------------------


def test_parse_failure_summary_root_cause_first() -> None:
    failed = parse_failure_summary("noise\n" + SUMMARY)
    assert failed[0] == {"rank": 3, "local_rank": 1, "exit_code": -9, "signal": 9,
                         "pid": 1002, "message": "Signal 9 (SIGKILL) received by PID 1002"}
    assert failed[1]["rank"] == 0 and failed[1]["exit_code"] == 1
    assert failed[1]["signal"] is None
    assert failed[1]["message"] == "RuntimeError: Connection reset by peer"


def test_parse_failure_summary_without_summary() -> None:
    assert parse_failure_summary("just a log line\nanother") == []


# -- config ----------------------------------------------------------------------------------


def test_config_rules_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="after '--'"):
        AgentConfig(supervisor_url="http://s", run="r", command=[], state_dir=tmp_path)
    with pytest.raises(ValueError, match="http"):
        AgentConfig(supervisor_url="s:8080", run="r", command=["x"], state_dir=tmp_path)
    for bad in (" ", "-x", "a b", "a/b"):
        with pytest.raises(ValueError, match="--run"):
            AgentConfig(supervisor_url="http://s", run=bad, command=["x"], state_dir=tmp_path)
    with pytest.raises(ValueError, match=r"^AgentConfig\.stop_grace_s must be >= 0 \(got -1\)$"):
        AgentConfig(supervisor_url="http://s", run="r", command=["x"], state_dir=tmp_path,
                    stop_grace_s=-1)
    with pytest.raises(ValueError, match=r"^AgentConfig\.tick_interval_s must be <= "
                                         r"batch_interval_s = 1 \(got 2\)$"):
        AgentConfig(supervisor_url="http://s", run="r", command=["x"], state_dir=tmp_path,
                    tick_interval_s=2)


def test_the_preflight_options_from_the_command_line(tmp_path: Path) -> None:
    import argparse

    from trainwarden.agent.cli import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    base = ["--supervisor", "http://s", "--run", "r", "--state-dir", str(tmp_path)]
    cfg = config_from_args(parser.parse_args([*base, "--", "torchrun", "t.py"]))
    assert cfg.preflight and cfg.preflight_timeout_s == protocol.PREFLIGHT_TIMEOUT_S == 4.0
    assert cfg.worker_env == {protocol.ENV_PREFLIGHT: "1",
                              protocol.ENV_PREFLIGHT_TIMEOUT: "4.0"}
    cfg = config_from_args(parser.parse_args(
        [*base, "--no-preflight", "--preflight-timeout", "10", "--", "torchrun", "t.py"]))
    assert cfg.worker_env == {protocol.ENV_PREFLIGHT: "0",
                              protocol.ENV_PREFLIGHT_TIMEOUT: "10.0"}
    with pytest.raises(ValueError, match=r"^AgentConfig\.preflight_timeout_s must be a finite "
                                         r"number > 0 \(got 0\.0\); the default is 4$"):
        config_from_args(parser.parse_args(
            [*base, "--preflight-timeout", "0", "--", "torchrun", "t.py"]))


def test_config_socket_path_fits_and_nproc(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 120)
    cfg = AgentConfig(supervisor_url="http://s/", run="r", node="n", state_dir=deep,
                      command=["torchrun", "--nproc-per-node", "4", "t.py"])
    assert len(str(cfg.socket_path)) <= 100
    assert cfg.socket_path == AgentConfig(supervisor_url="http://s", run="r", node="n",
                                          state_dir=deep, command=["x"]).socket_path
    assert cfg.nproc_per_node == 4 and cfg.supervisor_url == "http://s"


# -- monitor: datagram socket ---------------------------------------------------------------


def test_disk_usage_of_a_missing_dir_is_its_parents(tmp_path: Path) -> None:
    usage = disk_usage(tmp_path / "not" / "yet")
    assert usage is not None
    free, total = usage
    assert 0 < free <= total and disk_usage(None) is None


class FakeNvml:
    """The part of pynvml that GpuHealth uses: two GPUs, one without power readings."""

    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0

    class NotSupported(Exception):
        pass

    def __init__(self, fail_init: Exception | None = None) -> None:
        self.fail_init = fail_init
        self.inits = 0

    def nvmlInit(self) -> None:
        self.inits += 1
        if self.fail_init:
            raise self.fail_init

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return type("Mem", (), {"used": (h + 1) * 2**30, "total": 141 * 2**30})()

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return type("Util", (), {"gpu": 90 + h})()

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        if h == 1:
            raise self.NotSupported("not supported")
        return 612_345

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 60 + h

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        assert (kind, counter) == (1, 0)
        return 4 * h


def test_gpu_health_reads_every_device_and_leaves_unsupported_readings_out() -> None:
    nvml = FakeNvml()
    g = GpuHealth(nvml)
    first = g.read()
    assert g.read() == first and nvml.inits == 1  # initialised once
    assert first == {"available": True, "devices": [
        {"index": 0, "name": "NVIDIA H200", "util_percent": 90, "mem_used_bytes": 2**30,
         "mem_total_bytes": 141 * 2**30, "temp_c": 60, "power_w": 612.3,
         "ecc_uncorrected": 0},
        {"index": 1, "name": "NVIDIA H200", "util_percent": 91, "mem_used_bytes": 2 * 2**30,
         "mem_total_bytes": 141 * 2**30, "temp_c": 61, "power_w": None,
         "ecc_uncorrected": 4}]}


class XidNvml(FakeNvml):
    """FakeNvml that delivers XID events (GPU 1 does not support them)."""

    nvmlEventTypeXidCriticalError = 8

    class Timeout(Exception):
        pass

    def __init__(self) -> None:
        super().__init__()
        self.pending: list[tuple[int, int]] = []  # (device handle, xid)

    def nvmlEventSetCreate(self) -> str:
        return "set"

    def nvmlDeviceRegisterEvents(self, h: int, kinds: int, events: str) -> None:
        assert (kinds, events) == (8, "set")
        if h == 1:
            raise self.NotSupported("not supported")

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0  # never waits
        if not self.pending:
            raise self.Timeout("timed out")
        device, xid = self.pending.pop(0)
        return SimpleNamespace(device=device, eventData=xid, eventType=8)


def test_gpu_health_counts_hardware_xid_errors_not_the_applications() -> None:
    nvml = XidNvml()
    g = GpuHealth(nvml)
    d0, d1 = g.read()["devices"]
    assert (d0["xid_errors"], d0["xid_last"]) == (0, None)
    assert "xid_errors" not in d1  # no events on that device: not read, not 0
    nvml.pending = [(0, 79), (0, 13), (0, 31), (0, 48)]  # 13 and 31: the application's
    d0, _ = g.read()["devices"]
    assert (d0["xid_errors"], d0["xid_last"]) == (2, 48)
    assert g.read()["devices"][0]["xid_errors"] == 2  # counted once


def test_gpu_health_without_nvml_says_why_and_never_raises() -> None:
    g = GpuHealth(FakeNvml(fail_init=RuntimeError("driver not loaded")))
    assert g.read() == {"available": False, "reason": "RuntimeError: driver not loaded"}
    # The real NVML bindings on this machine: no driver, no GPU.
    real = GpuHealth().read()
    if real["available"]:
        pytest.skip("this machine has GPUs: the not-available path is the fake's above")
    assert real["reason"] and "NVML" in real["reason"]


def test_receiver_counts_invalid_and_overflow(tmp_path: Path) -> None:
    rx = DatagramReceiver(tmp_path / "a.sock", queue_max=2)
    tx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        tx.sendto(b"not json", str(rx.path))
        tx.sendto(b'{"type": "weird"}', str(rx.path))
        tx.sendto(b'{"type": "step", "rank": -1, "step": 0}', str(rx.path))
        tx.sendto(b'{"type": "event", "name": ""}', str(rx.path))
        for step in range(3):
            msg: protocol.StepReport = {"type": "step", "rank": 0, "step": step,
                                        "loss": float("nan")}
            tx.sendto(protocol.encode_datagram(msg), str(rx.path))
        assert rx.drain() == 2
        assert rx.invalid == 4 and rx.overflow == 1
        got = rx.take()
        assert [m["step"] for m in got] == [0, 1]
        assert got[0]["loss"] != got[0]["loss"]  # NaN survives: it is the signal
        assert rx.drain() == 0  # non-blocking when empty
    finally:
        tx.close()
        rx.close()


# -- spool -----------------------------------------------------------------------------------


def _batch(seq: int, n: int = 1) -> dict[str, Any]:
    return {"seq": seq, "attempt": 0, "items": [{"type": "step", "step": i} for i in range(n)]}


def test_spool_bound_drops_oldest_with_count(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=10**9, max_batches=3)
    for seq in range(5):
        spool.add(_batch(seq, n=2))
    assert spool.seqs() == [2, 3, 4]
    assert spool.dropped_items == 4 and spool.dropped_batches == 2
    # The batch on the wire is never dropped; the next oldest goes instead.
    assert spool.oldest() is not None and spool.in_flight == 2
    spool.add(_batch(5))
    assert spool.seqs() == [2, 4, 5]
    # Survives a restart, oldest first.
    again = Spool(tmp_path / "spool", max_bytes=10**9, max_batches=3)
    entry = again.oldest()
    assert entry is not None and entry[0] == 2 and entry[1]["items"][1]["step"] == 1


def test_spool_byte_bound(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=1500, max_batches=100)
    for seq in range(10):
        spool.add(_batch(seq, n=10))  # ~300 bytes each
    assert spool.bytes <= 1500 and spool.seqs()[-1] == 9
    assert spool.dropped_batches == 10 - len(spool.seqs())


def test_spool_renumber_keeps_order(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool", max_bytes=10**9, max_batches=100)
    for seq in range(3):
        spool.add(_batch(seq, n=seq + 1))
    assert spool.renumber(50) == 50
    assert spool.seqs() == [50, 51, 52]
    entry = spool.oldest()
    assert entry is not None and entry[1]["seq"] == 50 and len(entry[1]["items"]) == 1


# -- uplink ----------------------------------------------------------------------------------


def _uplink(tmp_path: Path, fake: FakeSupervisor, clock: Clock, **kw: Any) -> Uplink:
    return Uplink(supervisor_url="http://sup.test", token="agent-token",
                  state_dir=tmp_path, register_request={"run": "r", "node": "n"},
                  transport=fake.transport(), clock=clock, **kw)


HB = {"type": "heartbeat", "state": "running", "workers": [], "disk_free_bytes": 1}


def test_uplink_seq_increases_and_heartbeat_in_every_batch(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    up = _uplink(tmp_path, fake, clock)
    for i in range(3):
        up.enqueue([{"type": "step", "step": i}], HB, attempt=0)
        up.pump()
    assert fake.seqs() == [0, 1, 2]
    for seq in range(3):
        batch = fake.batches[seq]
        assert batch["agent_id"] == 7 and batch["dropped"] == 0
        assert [i["type"] for i in batch["items"]] == ["step", "heartbeat"]
    assert fake.registers[0]["run"] == "r"
    up.close()


def test_uplink_spools_while_down_and_replays_in_order(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    up = _uplink(tmp_path, fake, clock)
    up.enqueue([{"type": "step", "step": 0}], HB, 0)
    up.pump()
    fake.down = "connect"
    for step in range(1, 6):
        up.enqueue([{"type": "step", "step": step}], HB, 0)
        clock.t += 1
        up.pump()
    fake.down = "503"
    clock.t += 20
    up.pump()
    assert up.pending == 5 and fake.seqs() == [0]
    fake.down = None
    clock.t += 20  # past the backoff
    up.pump()
    assert up.pending == 0
    assert fake.arrivals == [0, 1, 2, 3, 4, 5] and fake.duplicates == 0
    assert [i["step"] for i in fake.items("step")] == [0, 1, 2, 3, 4, 5]
    up.close()


def test_uplink_backs_off_without_blocking(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    fake.down = "connect"
    up = _uplink(tmp_path, fake, clock)
    up.enqueue([], HB, 0)
    up.pump()
    calls = len(fake.registers)
    up.pump()  # within the backoff: no new attempt
    assert len(fake.registers) == calls and up.registration is None
    up.close()


def test_uplink_reports_drops_when_spool_full(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    fake.down = "connect"
    up = _uplink(tmp_path, fake, clock, spool_max_batches=3)
    for step in range(6):
        up.enqueue([{"type": "step", "step": step}], HB, 0)
    fake.down = None
    clock.t += 60
    up.pump()
    assert fake.seqs() == [3, 4, 5]
    assert all(fake.batches[s]["dropped"] == 6 for s in (3, 4, 5))  # 3 steps + 3 heartbeats
    up.close()
    # The drop count is cumulative across agent restarts.
    up2 = _uplink(tmp_path, fake, clock)
    up2.enqueue([], HB, 0)
    up2.pump()
    assert fake.batches[6]["dropped"] == 6
    up2.close()


def test_uplink_rejected_batch_does_not_wedge(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    fake.status_for_seq[1] = 422
    up = _uplink(tmp_path, fake, clock)
    for step in range(3):
        up.enqueue([{"type": "step", "step": step}], HB, 0)
    up.pump()
    assert fake.seqs() == [0, 2] and up.pending == 0 and up.dead_lettered == 1
    assert list((tmp_path / "dead-letter").glob("000000000001-*.json"))


def test_uplink_sets_a_failing_batch_aside_once_newer_ones_are_accepted(
        tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    fake.status_for_seq[1] = 500
    up = _uplink(tmp_path, fake, clock, max_5xx_tries=3)
    for step in range(3):
        up.enqueue([{"type": "step", "step": step}], HB, 0)
    for _ in range(5):
        up.pump()
        clock.t += 20
    assert fake.seqs() == [0, 2] and up.pending == 0 and up.dead_lettered == 1
    assert "HTTP 500" in (tmp_path / "dead-letter" / "000000000001-2.reply.txt").read_text()
    # The next batch announces it, first in line.
    up.enqueue([], HB, 0)
    up.pump()
    notice = fake.batches[3]["items"][0]
    assert notice["name"] == "batch_dead_lettered"
    assert {k: notice["details"][k] for k in ("seq", "status", "count", "items")} == \
        {"seq": 1, "status": 500, "count": 1, "items": 2}
    up.enqueue([], HB, 0)
    up.pump()
    assert [i["type"] for i in fake.batches[4]["items"]] == ["heartbeat"]  # announced once
    up.close()


def test_uplink_outage_of_5xx_sets_nothing_aside(tmp_path: Path) -> None:
    """Every batch answered 500 (a database down behind the supervisor): none is the batch's
    fault, so none is set aside, however long it lasts; all arrive once it is back."""
    fake, clock = FakeSupervisor(), Clock()
    up = _uplink(tmp_path, fake, clock, max_5xx_tries=2)
    up.enqueue([], HB, 0)
    up.pump()  # registered
    fake.down = "500"
    for step in range(20):
        up.enqueue([{"type": "step", "step": step}], HB, 0)
        up.pump()
        clock.t += 20
    assert up.dead_lettered == 0 and up.pending == 20
    fake.down = None
    up.pump()
    assert up.pending == 0 and up.dead_lettered == 0
    assert [i["step"] for i in fake.items("step")] == list(range(20))
    up.close()


def test_uplink_4xx_for_token_trouble_or_overload_is_never_final(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    up = _uplink(tmp_path, fake, clock, max_5xx_tries=1)
    up.enqueue([], HB, 0)
    up.pump()
    for code in ("401", "403", "408", "429", "502", "503", "504"):
        fake.down = code
        up.enqueue([], HB, 0)
        for _ in range(3):
            up.pump()
            clock.t += 20
    assert up.dead_lettered == 0 and up.pending == 7
    fake.down = None
    up.pump()
    assert fake.seqs() == list(range(8))
    up.close()


def test_dead_letter_store_is_bounded_oldest_first_and_counted(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    for seq in range(6):
        fake.status_for_seq[seq] = 422
    up = _uplink(tmp_path, fake, clock, dead_letter_max_batches=4,
                 dead_letter_max_bytes=10**9)
    for step in range(6):
        up.enqueue([{"type": "step", "step": step}], HB, 0)
    up.pump()
    kept = sorted(p.name.split("-")[0] for p in (tmp_path / "dead-letter").glob("*.json"))
    assert kept == [f"{s:012d}" for s in (2, 3, 4, 5)]
    assert len(list((tmp_path / "dead-letter").glob("*.reply.txt"))) == 4
    assert up.dead_lettered == 6 and up.dead_letter_dropped == 2
    up.close()
    # The counts survive the agent; the announcements not yet sent too.
    up2 = _uplink(tmp_path, fake, clock)
    assert up2.dead_lettered == 6 and up2.dead_letter_dropped == 2
    up2.enqueue([], HB, 0)
    up2.pump()
    notices = [i for i in fake.batches[6]["items"] if i.get("name") == "batch_dead_lettered"]
    assert [n["details"]["seq"] for n in notices] == list(range(6))
    assert notices[-1]["details"]["dropped"] == 2
    up2.close()
    # A byte bound: one big entry pushes the older ones out, the newest always stays.
    small = DeadLetters(tmp_path / "dl2", max_bytes=1000, max_batches=100)
    for seq, size in ((0, 300), (1, 300), (2, 900)):
        f = tmp_path / f"{seq:012d}-1.json"
        f.write_bytes(b"x" * size)
        small.put(f, "HTTP 422")
    assert [p.name for p in small.entries()] == ["000000000002-1.json"] and small.dropped == 2


def test_uplink_bad_token_keeps_batches(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(token="other"), Clock()
    up = _uplink(tmp_path, fake, clock)
    up.enqueue([{"type": "step", "step": 0}], HB, 0)
    up.pump()
    assert up.pending == 1 and up.registration is None
    up.close()


def test_uplink_seq_survives_restart_and_follows_supervisor(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    up = _uplink(tmp_path, fake, clock)
    up.enqueue([], HB, 0)
    up.enqueue([], HB, 0)
    up.pump()
    up.close()
    up2 = _uplink(tmp_path, fake, clock)
    assert up2.enqueue([], HB, 0) == [2]
    up2.pump()
    up2.close()
    # State dir lost, supervisor remembers seq 0..2: spooled batches are renumbered, not lost.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    up3 = _uplink(fresh, fake, clock)
    assert up3.enqueue([{"type": "step", "step": 99}], HB, 0) == [0]
    up3.pump()
    assert fake.seqs() == [0, 1, 2, 3] and fake.batches[3]["items"][0]["step"] == 99
    assert up3.enqueue([], HB, 0) == [4]
    up3.close()


def test_uplink_splits_large_batches(tmp_path: Path) -> None:
    fake, clock = FakeSupervisor(), Clock()
    up = _uplink(tmp_path, fake, clock, max_items_per_batch=4)
    up.enqueue([{"type": "step", "step": i} for i in range(10)], HB, 0)
    up.pump()
    assert fake.seqs() == [0, 1, 2]
    assert all(fake.batches[s]["items"][-1]["type"] == "heartbeat" for s in range(3))
    assert [i["step"] for i in fake.items("step")] == list(range(10))
    up.close()


# -- executor --------------------------------------------------------------------------------


class FakeHost:
    def __init__(self) -> None:
        self.attempt = 0
        self.calls: list[Any] = []
        self.stopping = False
        self.finished = False

    def begin_stop(self, *, immediate: bool = False) -> None:
        self.calls.append("kill" if immediate else "stop")
        self.stopping = True

    def collect_stacks(self, reason: str, command_id: int | None) -> None:
        self.calls.append(("stacks", command_id))

    def pin_checkpoint(self, path: str, reason: str) -> None:
        self.calls.append(("pin", path))

    def stopped(self) -> bool:
        return not self.stopping

    def launch(self, attempt: int, plan_path: Path | None) -> None:
        self.calls.append(("launch", attempt, plan_path))
        self.attempt = attempt

    def finish(self, end: object) -> None:
        self.finished = True
        self.ended = end

    def place(self, plan: protocol.ResumePlan | None) -> str | None:
        m = plan.membership if plan is not None else None
        return None if m is None or "n0" in m.get("members", {}) else "not a member"

    def stand_by(self, attempt: int, reason: str) -> None:
        self.calls.append(("stand_by", attempt, reason))
        self.attempt = attempt


def test_executor_restart_once_with_plan_and_backoff(tmp_path: Path) -> None:
    host, clock = FakeHost(), Clock()
    out: list[dict[str, Any]] = []
    ex = Executor(tmp_path, host, out.append, clock)
    cmd: protocol.Command = {
        "id": 5, "kind": "restart", "attempt": 2, "not_before": clock.t + 10,
        "plan": {"checkpoint": "/ck/step_40", "skip": [[10, 19]],
                 "lr": {"scale": 0.5, "steps": 20}, "reason": "spike"},
    }
    ex.submit([cmd])
    ex.submit([cmd])  # re-sent before our result arrived: applied once
    ex.tick()
    # The resume target is pinned before the workers are stopped (they may still prune).
    assert host.calls == [("pin", "/ck/step_40"), "stop"]
    host.stopping = False
    ex.tick()
    assert host.calls == [("pin", "/ck/step_40"), "stop"]  # waiting for not_before
    clock.t += 10
    ex.tick()
    assert host.calls[2][:2] == ("launch", 2)
    plan = protocol.ResumePlan.from_json(host.calls[2][2].read_text())
    assert plan.checkpoint == "/ck/step_40" and plan.skip == ((10, 19),) and plan.attempt == 2
    assert [(i["command_id"], i["status"]) for i in out] == [(5, "delivered"), (5, "done")]
    # A later incarnation does not apply it again, but repeats the result when asked.
    ex2 = Executor(tmp_path, host, out.append, clock)
    ex2.submit([cmd])
    ex2.tick()
    assert len(host.calls) == 3 and out[-1]["status"] == "done"


def test_executor_rejects_bad_plan_without_stopping(tmp_path: Path) -> None:
    host = FakeHost()
    out: list[dict[str, Any]] = []
    ex = Executor(tmp_path, host, out.append, Clock())
    ex.submit([{"id": 1, "kind": "restart", "attempt": 1, "plan": {"bogus": 1}},
               {"id": 2, "kind": "dance"}])
    ex.tick()
    assert host.calls == []
    assert [i["status"] for i in out] == ["delivered", "delivered", "failed", "failed"]
    assert "unknown fields" in out[3]["detail"] and "unknown command" in out[2]["detail"]


def test_executor_stop_supersedes_waiting_restart(tmp_path: Path) -> None:
    host, clock = FakeHost(), Clock()
    out: list[dict[str, Any]] = []
    ex = Executor(tmp_path, host, out.append, clock)
    ex.submit([{"id": 1, "kind": "restart", "attempt": 1, "plan": None,
                "not_before": clock.t + 100}])
    ex.tick()
    host.stopping = False
    ex.tick()
    ex.submit([{"id": 2, "kind": "stop"}])
    ex.tick()
    host.stopping = False
    ex.tick()
    assert host.finished
    results = [(i["command_id"], i["status"]) for i in out]
    assert (1, "failed") in results and (2, "done") in results
    assert not any(c[0] == "launch" for c in host.calls if isinstance(c, tuple))


def test_executor_interrupted_restart_counts_if_relaunched(tmp_path: Path) -> None:
    (tmp_path / "commands.json").write_text(json.dumps(
        {"9": {"status": "delivered", "kind": "restart", "attempt": 3}}))
    host = FakeHost()
    out: list[dict[str, Any]] = []
    host.attempt = 3  # the previous agent already launched attempt 3
    ex = Executor(tmp_path, host, out.append, Clock())
    ex.submit([{"id": 9, "kind": "restart", "attempt": 3}])
    ex.tick()
    assert host.calls == [] and out[-1]["status"] == "done"


def test_nan_loss_crosses_the_wire(fake_run, fake_supervisor) -> None:  # type: ignore[no-untyped-def]
    """A NaN loss is the signal of a diverged run: the batch carrying it must be sent."""
    from trainwarden.agent.uplink import Uplink

    up = Uplink(supervisor_url="http://supervisor.test", token="agent-token",
                state_dir=fake_run.state_dir, register_request={"run": "run1", "node": "n"},
                transport=fake_supervisor.transport())
    up.enqueue([{"type": "step", "rank": 0, "step": 3, "loss": float("nan"),
                 "grad_norm": float("inf")}], {"type": "heartbeat", "t": 1.0}, 0)
    up.pump()
    up.pump()
    (s,) = fake_supervisor.items("step")
    assert s["loss"] != s["loss"] and s["grad_norm"] == float("inf")
    assert up.pending == 0


def test_local_watchdog_gives_teardown_its_allowance() -> None:
    from trainwarden.agent.core.hang import HangConfig
    from trainwarden.agent.watchdog import HangWatch

    watch = HangWatch(HangConfig(floor_s=5.0, warmup_s=5.0, finish_s=60.0))
    watch.new_attempt(0, 1000.0)
    for step in range(20):
        for rank in (0, 1):
            watch.observe({"type": "step", "attempt": 0, "rank": rank, "step": step,
                           "t": 1001.0 + 0.1 * step})
    last = 1001.0 + 0.1 * 19
    assert watch.check(last + 30.0) is not None  # no report: a 30 s stall is a hang
    watch.observe({"type": "event", "attempt": 0, "rank": 0, "name": "worker_finished",
                   "t": last + 0.05})
    assert watch.check(last + 30.0) is None  # the loop is done: teardown
    late = watch.check(last + 61.0)
    assert late is not None
    assert late.details["phase"] == "finishing"


def test_executor_stands_by_when_the_membership_leaves_this_node_out(tmp_path: Path) -> None:
    """A restart whose membership does not name this node stops its workers and launches
    nothing: the command is done, with why."""
    host, clock = FakeHost(), Clock()
    out: list[dict[str, Any]] = []
    ex = Executor(tmp_path, host, out.append, clock)
    membership = {"epoch": 1, "nnodes": 2, "endpoint": "h:1", "members": {"n1": 0, "n2": 1},
                  "waiting": []}
    ex.submit([{"id": 9, "kind": "restart", "attempt": 3,
                "plan": {"reason": "node lost", "membership": membership}}])
    for _ in range(3):
        host.stopping = False
        ex.tick()
    assert ("stand_by", 3, "not a member") in host.calls
    assert not [c for c in host.calls if c[0] == "launch"]
    assert [(o["command_id"], o["status"]) for o in out] == [(9, "delivered"), (9, "done")]
    assert out[-1]["detail"] == "not a member"


def test_a_torchrun_command_the_supervisor_cannot_rewrite_fails_at_once_with_the_fix(
        capsys: pytest.CaptureFixture[str]) -> None:
    from trainwarden.agent import cli as agent_cli

    code = agent_cli.main(["--supervisor", "http://127.0.0.1:9", "--run", "r", "--",
                           "torchrun", "--nnodes=1:4", "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and "--nnodes=1:4" in err and "--nnodes=4" in err and "--spare" in err


def test_min_nodes_beyond_the_declared_world_fails_at_once_with_the_fix(
        capsys: pytest.CaptureFixture[str]) -> None:
    from trainwarden.agent import cli as agent_cli

    code = agent_cli.main(["--supervisor", "http://127.0.0.1:9", "--run", "r", "--min-nodes",
                           "3", "--", "torchrun", "--nnodes=2", "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and "--min-nodes 3" in err and "from 1 to 2" in err, err
    parser = argparse.ArgumentParser()
    agent_cli.add_arguments(parser)
    cfg = agent_cli.config_from_args(parser.parse_args(
        ["--supervisor", "http://127.0.0.1:9", "--run", "r", "--min-nodes", "1", "--",
         "torchrun", "--nnodes=2", "train.py"]))
    assert cfg.min_nodes == 1

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.waiting import wait_for
from trainwarden.agent.protocol import decode_datagrams
from trainwarden.agent.worker.report import (
    PhaseTimer,
    Reporter,
    declare_flops,
    report_step,
    set_reporter,
)


def test_without_an_agent_reports_are_dropped_and_counted() -> None:
    r = Reporter(None)
    r.path = None
    assert not r.step(1, loss=0.5)
    assert r.dropped == 1 and r.sent == 0


def test_agent_socket_missing_never_raises(tmp_path: Path) -> None:
    r = Reporter(str(tmp_path / "nobody-listens.sock"))
    set_reporter(r)
    try:
        report_step(3, loss=1.0)  # module-level call: no exception, just a drop
        report_step(4, loss=object())  # an unconvertible value is dropped too
        r.flush()
    finally:
        set_reporter(None)
    assert r.dropped == 2 and r.sent == 0


def test_step_report_reaches_the_agent(receiver, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import torch

    r = Reporter(receiver.path, rank=1, local_rank=1, world_size=2)
    timer = PhaseTimer()
    timer.start()
    timer.data_ready()
    timer.compute_done()
    timer.stop()
    assert r.step(7, loss=torch.tensor(float("nan")), samples=64, lr=1e-3,
                  grad_norm=torch.tensor(2.0), data_s=timer.data_s, compute_s=timer.compute_s,
                  step_s=timer.step_s, batch_index=9)
    r.event("custom", "hello", step=7)
    wait_for(lambda: len(receiver.messages) == 2)  # sent by the reporter's own thread
    step, event = receiver.messages
    assert step["type"] == "step" and step["rank"] == 1 and step["step"] == 7
    assert step["loss"] != step["loss"]  # NaN survives the wire: it is the signal
    assert step["grad_norm"] == 2.0 and step["batch_index"] == 9 and step["samples"] == 64
    assert step["data_s"] >= 0 and step["compute_s"] >= 0 and step["step_s"] >= 0
    assert event["name"] == "custom" and event["message"] == "hello"


def test_flops_declaration_reaches_the_agent_and_bad_numbers_are_refused(
        receiver, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    r = Reporter(receiver.path, rank=0, local_rank=0, world_size=2)
    set_reporter(r)
    try:
        declare_flops(flops_per_sample=6e6, peak_flops_per_rank=1e11, baseline_per_device=40.0)
        for bad in ({"flops_per_sample": 1.0, "flops_per_token": 1.0},
                    {"flops_per_sample": -5.0}, {"flops_per_token": float("nan")}, {},
                    {"flops_per_sample": 1.0, "baseline_per_device": 0.0}):
            with pytest.raises(ValueError, match="declare_flops"):
                declare_flops(peak_flops_per_rank=1e11, **bad)
        with pytest.raises(ValueError, match="peak_flops_per_rank"):
            declare_flops(flops_per_sample=1.0, peak_flops_per_rank=0)
        wait_for(lambda: len(receiver.messages) == 1)
    finally:
        set_reporter(None)
    (ev,) = receiver.messages
    assert ev["name"] == "flops_declared"
    assert ev["details"] == {"peak_flops_per_rank": 1e11, "flops_per_sample": 6e6,
                             "flops_per_token": None, "baseline_per_device": 40.0}


def test_full_agent_queue_drops_instead_of_blocking(tmp_path: Path) -> None:
    path = str(tmp_path / "slow-agent.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(path)  # bound but never read: its queue fills up
    try:
        r = Reporter(path, sender_thread=False)  # nothing drains the queue behind our back
        r.max_queue = 100
        queued = [r.step(i, loss=1.0) for i in range(5000)]
        # The training thread only queues; past the bound, reports are dropped, not waited on.
        assert queued.count(True) <= 100 and r.dropped >= 4900
        r.flush(budget_s=2.0)
        assert r.sent > 0 and r.sent + r.dropped == 5000
        assert decode_datagrams(sink.recv(70_000))[0][0]["step"] == 0
    finally:
        sink.close()




def test_control_characters_in_an_event_message_go_escaped(  # type: ignore[no-untyped-def]
        receiver) -> None:
    """The supervisor refuses control characters in a message (and with them the whole
    batch): a colourised message reaches it escaped, its line breaks kept."""
    r = Reporter(receiver.path, rank=0, local_rank=0, world_size=1)
    r.event("custom", "\x1b[31mred\x1b[0m\tand\nmore\x00")
    wait_for(lambda: len(receiver.messages) == 1)
    assert receiver.messages[0]["message"] == "\\x1b[31mred\\x1b[0m\tand\nmore\\x00"

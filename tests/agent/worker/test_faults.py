from __future__ import annotations

import pytest
import torch

from trainwarden.agent.worker.faults import Fault, FaultInjector, parse_fault


def test_parse() -> None:
    assert parse_fault("crash@12:rank=1") == Fault("crash", 12, rank=1)
    assert parse_fault("spike@40:len=5:scale=10") == Fault("spike", 40, length=5, scale=10.0)
    assert parse_fault("slow@3:factor=2") == Fault("slow", 3, factor=2.0)


@pytest.mark.parametrize("spec, msg", [
    ("boom@3", "KIND one of"), ("crash", "KIND@STEP"), ("crash@x", "STEP must be an integer"),
    ("crash@-1", ">= 0"), ("crash@1:when=2", "unknown option"), ("slow@1:factor=0.5", "factor"),
])
def test_parse_errors(spec: str, msg: str) -> None:
    with pytest.raises(ValueError, match=msg):
        parse_fault(spec)


def test_first_attempt_only_for_process_faults_but_data_faults_recur() -> None:
    faults = [parse_fault("crash@5"), parse_fault("spike@10:len=2")]
    first = FaultInjector(faults, rank=1, world_size=2, attempt=0)
    later = FaultInjector(faults, rank=1, world_size=2, attempt=1)
    assert [f.kind for f in first.faults] == ["crash", "spike"]
    assert [f.kind for f in later.faults] == ["spike"]
    other_rank = FaultInjector(faults, rank=0, world_size=2, attempt=0)
    assert [f.kind for f in other_rank.faults] == ["spike"]  # crash defaults to rank 1


def test_spike_and_nan_corrupt_only_their_batches() -> None:
    inj = FaultInjector([parse_fault("spike@10:len=2"), parse_fault("nan@20")], rank=0,
                        world_size=2, attempt=3)
    x, y = torch.ones(2, 3), torch.ones(2, 1)
    assert all(torch.equal(a, b) for a, b in zip(inj.corrupt(9, x, y), (x, y), strict=True))
    assert inj.corrupt(11, x, y)[0].abs().max() > 10
    assert torch.isnan(inj.corrupt(20, x, y)[0]).all()
    assert torch.equal(inj.corrupt(12, x, y)[0], x)


def test_with_a_marker_dir_each_process_fault_fires_once_per_run(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A schedule in one run: the crash at 5 fired in attempt 0, so attempt 1 (which trains
    step 5 again after resuming from an earlier checkpoint) does not crash there, but the slow
    spell at 8 that attempt 0 never reached fires in attempt 1, for its 3 steps only."""
    from trainwarden.agent.worker import faults as mod

    monkeypatch.setattr(mod, "get_reporter", lambda: type("R", (), {
        "event": lambda self, *a, **k: True})())
    slept: list[float] = []
    sched = [parse_fault("crash@5"), parse_fault("slow@8:len=3:factor=2")]
    assert str(sched[1]) == "slow@8:len=3"
    first = FaultInjector(sched, rank=1, world_size=2, attempt=0, fired_dir=tmp_path)
    assert [f.kind for f in first.faults] == ["crash", "slow"]
    first._announce(first.faults[0], 5)  # what before_step(5) does before the SIGKILL
    later = FaultInjector(sched, rank=1, world_size=2, attempt=1, fired_dir=tmp_path,
                          sleep=slept.append)
    assert [f.kind for f in later.faults] == ["slow"]
    for step in range(5, 14):
        later.slowdown(step, 0.5)
    assert slept == [0.5, 0.5, 0.5]  # steps 8, 9, 10
    again = FaultInjector(sched, rank=1, world_size=2, attempt=2, fired_dir=tmp_path)
    assert again.faults == []

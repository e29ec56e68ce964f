"""The framework-independent part of the callbacks: the step -> batch map, manifests (what
counts as a complete checkpoint), retention that honours pins and the grace, the choice of
the checkpoint a plan names, and the LR factor on the optimiser."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from trainwarden.agent.integrations._core import (
    OptimizerPlan,
    Retention,
    RunSession,
    batch_index_at,
    list_step_checkpoints,
    newest_surplus,
    validate_manifest,
    write_manifest,
)
from trainwarden.agent.protocol import (
    ENV_DECLARED_WORLD_SIZE,
    ENV_RESUME_PLAN,
    PIN_FILE,
    LRSchedule,
)

PATTERN = re.compile(r"^checkpoint-(\d+)$")


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def session(clock: Clock | None = None, grace: float = 30.0) -> RunSession:
    return RunSession(seed=1, keep=2, retention_grace_s=grace, save_every_s=None, sync_every=1,
                      config=None, reporter=None, clock=clock or Clock())


def make_checkpoint(root: Path, step: int, *, complete: bool = True) -> Path:
    p = root / f"checkpoint-{step}"
    p.mkdir(parents=True)
    (p / "model.bin").write_bytes(b"x" * (10 + step))
    (p / "trainwarden-rank0.json").write_text(json.dumps({"rng": None, "position": step}))
    if complete:
        write_manifest(p, {"step": step, "position": step, "world_size": 1, "seed": 1})
    return p


def test_batch_index_skips_the_ranges_and_continues_from_the_position() -> None:
    got = [batch_index_at(s, start_step=10, position=12, skip=[(14, 15), (18, 18)])
           for s in range(10, 17)]
    assert got == [12, 13, 16, 17, 19, 20, 21]
    assert batch_index_at(5, start_step=0, position=0, skip=[(0, 9)]) == 15
    with pytest.raises(ValueError, match="before the resumed step"):
        batch_index_at(3, start_step=4, position=4, skip=[])


def test_a_checkpoint_is_complete_only_with_its_manifest_and_every_file_at_size(
        tmp_path: Path) -> None:
    p = make_checkpoint(tmp_path, 5, complete=False)
    assert validate_manifest(p).reason.startswith("no trainwarden.json")
    write_manifest(p, {"step": 5})
    assert validate_manifest(p).ok
    (p / PIN_FILE).write_text("protected\n")  # a pin is not part of the checkpoint
    assert validate_manifest(p).ok
    (p / "model.bin").write_bytes(b"short")
    assert "model.bin has 5 bytes" in validate_manifest(p).reason
    (p / "model.bin").unlink()
    assert validate_manifest(p).reason == "file model.bin is missing"


def test_retention_keeps_pinned_ones_and_deletes_surplus_only_after_the_grace(
        tmp_path: Path) -> None:
    clock = Clock()
    for step in (10, 20, 30, 40):
        make_checkpoint(tmp_path, step)
    (tmp_path / "checkpoint-10" / PIN_FILE).write_text("last good\n")
    r = Retention(30.0, clock)
    surplus = newest_surplus(list_step_checkpoints(tmp_path, PATTERN), keep=2)
    assert surplus == {tmp_path / "checkpoint-20"}  # 10 is pinned, 30 and 40 the newest 2
    assert r.apply(surplus) == []  # within the grace
    clock.t += 29
    assert r.apply(surplus) == [] and not r.pending()
    clock.t += 1
    assert r.pending()
    assert r.apply(surplus) == [tmp_path / "checkpoint-20"]
    assert not (tmp_path / "checkpoint-20").exists()
    # A pinned checkpoint handed over as surplus (Lightning's top-k dropped it) stays...
    r.apply({tmp_path / "checkpoint-10"}, add=True)
    clock.t += 100
    assert r.apply(set(r.since)) == [] and (tmp_path / "checkpoint-10").exists()
    # ...until the pin is lifted.
    (tmp_path / "checkpoint-10" / PIN_FILE).unlink()
    assert r.apply(set(r.since)) == [tmp_path / "checkpoint-10"]


def test_resume_takes_the_plans_checkpoint_skips_and_lr(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (10, 20):
        make_checkpoint(tmp_path, step)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"checkpoint": str(tmp_path / "checkpoint-10"),
                                "skip": [[12, 14]], "lr": {"scale": 0.5, "steps": 3},
                                "lineage": "a1"}))
    monkeypatch.setenv(ENV_RESUME_PLAN, str(plan))
    s = session()
    r = s.resume(tmp_path, PATTERN)
    assert r.checkpoint == tmp_path / "checkpoint-10" and r.start_step == 10
    assert [s.batch_index(k) for k in range(10, 14)] == [10, 11, 15, 16]
    assert [s.lr_factor(k) for k in (9, 10, 12, 13)] == [1.0, 0.5, 0.5, 1.0]
    assert s.lineage == "a1"


def test_resume_without_a_plan_passes_over_an_incomplete_newest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_RESUME_PLAN, raising=False)
    make_checkpoint(tmp_path, 10)
    make_checkpoint(tmp_path, 20, complete=False)  # the save died half-way
    r = session().resume(tmp_path, PATTERN)
    assert r.checkpoint == tmp_path / "checkpoint-10"
    assert r.passed_over == [(tmp_path / "checkpoint-20",
                              "no trainwarden.json (the save never finished)")]


def test_a_plan_naming_an_incomplete_checkpoint_rolls_back_further_or_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    make_checkpoint(tmp_path, 20, complete=False)
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"checkpoint": str(tmp_path / "checkpoint-20")}))
    monkeypatch.setenv(ENV_RESUME_PLAN, str(plan))
    with pytest.raises(ValueError, match="no complete checkpoint precedes it"):
        session().resume(tmp_path, PATTERN)
    make_checkpoint(tmp_path, 10)
    assert session().resume(tmp_path, PATTERN).checkpoint == tmp_path / "checkpoint-10"


def test_resume_refuses_another_declared_world(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint of 4 ranks without a declared world ran on its full world: 4 declared."""
    monkeypatch.delenv(ENV_RESUME_PLAN, raising=False)
    monkeypatch.delenv(ENV_DECLARED_WORLD_SIZE, raising=False)
    p = make_checkpoint(tmp_path, 10, complete=False)
    write_manifest(p, {"step": 10, "position": 10, "world_size": 4})
    with pytest.raises(ValueError, match="declaring 4 ranks, this run declares 1: resuming "
                                         "would change the global batch; resume with "
                                         "TRAINWARDEN_DECLARED_WORLD_SIZE=4"):
        session().resume(tmp_path, PATTERN)


def test_resume_takes_a_checkpoint_of_more_ranks_of_the_same_declared_world(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shrunk to one rank of two declared: rank 0's RNG file is there and is restored later;
    the position is the global batch every rank shares."""
    monkeypatch.delenv(ENV_RESUME_PLAN, raising=False)
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    p = make_checkpoint(tmp_path, 10, complete=False)
    write_manifest(p, {"step": 10, "position": 10, "world_size": 2, "declared_world_size": 2})
    r = session().resume(tmp_path, PATTERN)
    assert (r.start_step, r.position) == (10, 10)


def test_the_lr_factor_applies_to_the_step_and_the_scheduler_never_sees_it() -> None:
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)  # chainable: reads group lr
    s = session()
    s.lr_schedule = LRSchedule(0.1, 1, 0, start_step=0)
    step = [0]
    plan = OptimizerPlan(s, lambda: step[0])
    plan.attach(opt)
    seen = []
    for k in range(3):
        step[0] = k
        w.grad = torch.ones(2)
        opt.step()
        seen.append(plan.lr)
        sched.step()
    assert seen == pytest.approx([0.1, 0.5, 0.25])  # x0.1 at step 0 only
    assert opt.param_groups[0]["lr"] == pytest.approx(0.125)  # the schedule, unscaled
    assert plan.grad_norm == pytest.approx(2 ** 0.5)

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from tests.agent.worker.rng import global_rng
from trainwarden.agent.protocol import LRSchedule, ResumePlan
from trainwarden.agent.worker import Checkpointer, ResumableLoader, list_checkpoints, read_meta
from trainwarden.agent.worker.checkpoint import PARTIAL_SUFFIX, validate_checkpoint
from trainwarden.agent.worker.report import Reporter

pytestmark = pytest.mark.usefixtures("world1")


def make(root: Path, *, keep: int = 3, declared: int | None = None, **kw):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    loader = ResumableLoader(data, batch_size=4, rank=0, world_size=1, seed=1,
                             declared_world_size=declared)
    kw.setdefault("reporter", Reporter(""))
    ckpt = Checkpointer(root, model, opt, loader=loader, keep=keep, seed=1,
                        config={"lr": 1e-2}, **kw)
    return model, opt, loader, ckpt


def train(model, opt, batches, n: int) -> float:  # type: ignore[no-untyped-def]
    loss = torch.tensor(0.0)
    for _ in range(n):
        x, y = next(batches).data
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return float(loss.detach())


def test_save_and_resume_restore_everything(tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path)
    batches = iter(loader)
    loss = train(model, opt, batches, 5)
    ckpt.save(5, loss=loss)
    saved_weights = [p.detach().clone() for p in model.parameters()]
    saved_exp_avg = opt.state[next(iter(model.parameters()))]["exp_avg"].clone()
    expected_next = [next(batches).index for _ in range(3)]
    train(model, opt, batches, 2)  # the run goes on after the save, then dies

    model2, opt2, loader2, ckpt2 = make(tmp_path)
    info = ckpt2.resume(None)
    assert info.start_step == 5 and info.checkpoint == tmp_path / "step_5"
    for a, b in zip(model2.parameters(), saved_weights, strict=True):
        assert torch.equal(a, b)
    p0 = next(iter(model2.parameters()))
    assert torch.equal(opt2.state[p0]["exp_avg"], saved_exp_avg)
    assert int(opt2.state[p0]["step"]) == 5
    it2 = iter(loader2)
    assert [next(it2).index for _ in range(3)] == expected_next == [5, 6, 7]
    meta = read_meta(tmp_path / "step_5")
    assert meta["step"] == 5 and meta["seed"] == 1 and meta["config"] == {"lr": 1e-2}
    assert meta["loss"] == pytest.approx(loss)


def test_rng_state_is_restored(tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path)
    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    ckpt.save(1)
    draws = (torch.rand(2).tolist(), random.random(), float(np.random.rand()))
    torch.manual_seed(99)
    random.seed(99)
    np.random.seed(99)
    _, _, _, ckpt2 = make(tmp_path)
    ckpt2.resume(None)
    assert (torch.rand(2).tolist(), random.random(), float(np.random.rand())) == draws


def test_incomplete_checkpoints_are_skipped_with_a_log_line(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, loader, ckpt = make(tmp_path, keep=10)
    batches = iter(loader)
    for step in (10, 20, 30):
        train(model, opt, batches, 1)
        ckpt.save(step)
    (tmp_path / "step_30" / ".metadata").unlink()  # died before the metadata was written
    shard = next((tmp_path / "step_20").glob("*.distcp"))
    with shard.open("r+b") as f:  # a truncated shard
        f.truncate(shard.stat().st_size // 2)
    (tmp_path / f"step_40{PARTIAL_SUFFIX}").mkdir()  # a save in progress when the process died

    assert not validate_checkpoint(tmp_path / "step_30").ok
    assert "bytes" in validate_checkpoint(tmp_path / "step_20").reason

    _, _, loader2, ckpt2 = make(tmp_path, keep=10)
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        info = ckpt2.resume(None)
    assert info.start_step == 10
    assert info.checkpoint == tmp_path / "step_10"
    text = caplog.text
    assert "skipping checkpoint" in text
    assert "step_30: no .metadata" in text
    assert f"step_20: shard {shard.name} has" in text
    assert loader2.position == 1


def test_plan_naming_a_missing_checkpoint_rolls_back_further_or_refuses(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, loader, ckpt = make(tmp_path, keep=5)
    for step in (2, 3, 5):
        ckpt.save(step)
    (tmp_path / "step_3" / ".metadata").unlink()
    # The plan's checkpoint is damaged: the newest complete one before it, never a later one.
    _, _, _, ckpt2 = make(tmp_path, keep=5)
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        info = ckpt2.resume(ResumePlan(checkpoint=str(tmp_path / "step_3"), skip=((9, 9),)))
    assert info.start_step == 2 and info.skip == [(9, 9)]
    assert "step_3: no .metadata" in caplog.text
    # Nothing complete at or before it: refused, with the reason.
    (tmp_path / "step_2" / ".metadata").unlink()
    _, _, _, ckpt3 = make(tmp_path, keep=5)
    with pytest.raises(ValueError, match=r"not complete \(no \.metadata.*no complete"):
        ckpt3.resume(ResumePlan(checkpoint=str(tmp_path / "step_3")))


@pytest.mark.parametrize("named", ["/etc", "../../..", "symlink", "elsewhere"])
def test_plan_naming_a_checkpoint_outside_the_directory_stops_the_worker(
        tmp_path: Path, named: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """DCP unpickles .metadata: only the Checkpointer's own directory is ever loaded."""
    root, other = tmp_path / "ck", tmp_path / "other"
    _, _, _, elsewhere = make(other)
    elsewhere.save(5)  # a complete checkpoint, just not this run's
    _, _, _, ckpt = make(root)
    ckpt.save(2)
    (root / "step_9").symlink_to(other / "step_5")
    monkeypatch.chdir(root)
    path = {"/etc": "/etc", "../../..": "../../..", "symlink": str(root / "step_9"),
            "elsewhere": str(other / "step_5")}[named]
    _, _, _, ckpt2 = make(root)
    with pytest.raises(ValueError, match=r"resume plan refused: checkpoint .* is not inside "
                                         r"this run.s checkpoint directory"):
        ckpt2.resume(ResumePlan(checkpoint=path))
    with pytest.raises(ValueError, match="not inside"):
        ckpt2.load(path)


def test_a_step_symlink_leading_out_of_the_directory_is_passed_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, other = tmp_path / "ck", tmp_path / "other"
    _, _, _, elsewhere = make(other)
    elsewhere.save(5)
    _, _, _, ckpt = make(root)
    ckpt.save(2)
    (root / "step_9").symlink_to(other / "step_5")
    _, _, _, ckpt2 = make(root)
    with caplog.at_level(logging.WARNING, logger="trainwarden"):
        info = ckpt2.resume(None)
    assert info.start_step == 2 and info.checkpoint == root / "step_2"
    assert f"step_9: resolves to {other / 'step_5'}, outside" in caplog.text


def test_retention_keeps_last_k_plus_pinned(tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path, keep=2, retention_grace_s=0)
    for step in (1, 2, 3):
        ckpt.save(step)
    assert [c.step for c in list_checkpoints(tmp_path)] == [2, 3]
    ckpt.pin(2, "last good before incident 7")
    for step in (4, 5, 6):
        ckpt.save(step)
    kept = list_checkpoints(tmp_path)
    assert [c.step for c in kept] == [2, 5, 6]
    assert [c.pinned for c in kept] == [True, False, False]
    ckpt.unpin(2)
    ckpt.save(7)
    assert [c.step for c in list_checkpoints(tmp_path)] == [6, 7]


def test_retention_waits_out_the_grace_so_a_late_pin_still_saves_the_checkpoint(
        tmp_path: Path) -> None:
    """Saves faster than the supervisor reacts: the checkpoint that fell out of the newest
    ``keep`` stays for the grace, a pin in that time keeps it for good, and without one it
    goes at the first ``due()`` after the grace."""
    now = [0.0]
    model, opt, loader, ckpt = make(tmp_path, keep=2, retention_grace_s=30.0,
                                    clock=lambda: now[0])
    for step in (1, 2, 3, 4):
        ckpt.save(step)
        now[0] += 1.0
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 2, 3, 4]
    ckpt.pin(1, "the supervisor's pin arrived late")
    now[0] += 28.0  # t=32: step 2 fell out of the newest two at t=3 (step 1 at t=2: pinned)
    assert not ckpt.due(5) and len(list_checkpoints(tmp_path)) == 4
    now[0] += 1.0
    assert not ckpt.due(5)
    assert [c.step for c in list_checkpoints(tmp_path)] == [1, 3, 4]
    with pytest.raises(ValueError, match="retention_grace_s"):
        make(tmp_path, retention_grace_s=-1)


def test_stale_partial_save_is_removed_and_never_used(tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path)
    ckpt.save(1)
    stale = tmp_path / f"step_2{PARTIAL_SUFFIX}"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    ckpt.save(2)  # overwrites the stale partial directory cleanly
    assert validate_checkpoint(tmp_path / "step_2").ok
    assert not stale.exists()


def test_due_on_steps_and_on_time(tmp_path: Path) -> None:
    now = [0.0]
    _, _, _, ckpt = make(tmp_path, every_steps=5, interval_s=60, sync_every=2,
                         clock=lambda: now[0])
    assert ckpt.due(5) and ckpt.due(10)
    assert not ckpt.due(4)  # neither a multiple of 5 nor late
    now[0] = 61.0
    assert not ckpt.due(3)  # late, but time is only checked every sync_every steps
    assert ckpt.due(4)
    ckpt.save(4)
    assert not ckpt.due(6)


def test_async_save_completes_and_validates(tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path, async_save=True)
    train(model, opt, iter(loader), 2)
    ckpt.save(2)
    ckpt.wait()
    assert validate_checkpoint(tmp_path / "step_2").ok
    assert not (tmp_path / f"step_2{PARTIAL_SUFFIX}").exists()


def test_plan_skips_and_lr_schedule_continue_in_later_checkpoints(tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path)
    train(model, opt, iter(loader), 4)
    ckpt.save(4)
    _, _, loader2, ckpt2 = make(tmp_path)
    plan = ResumePlan(skip=((6, 9),), lr=LRSchedule(0.5, steps=3, ramp_steps=2))
    info = ckpt2.resume(plan)
    assert info.start_step == 4
    assert [ckpt2.lr_factor(s) for s in range(3, 11)] == [1.0, 0.5, 0.5, 0.5, 0.75, 1.0, 1.0,
                                                          1.0]
    it = iter(loader2)
    assert [next(it).index for _ in range(4)] == [4, 5, 10, 11]
    assert loader2.skipped == [(6, 9)]
    ckpt2.save(8)  # steps 4..7 trained batches 4, 5, 10, 11
    # A crash now: the next start resumes from step_6 with no plan, and the schedule and
    # skip list saved in that checkpoint still hold.
    _, _, loader3, ckpt3 = make(tmp_path)
    assert ckpt3.resume(None).start_step == 8
    assert [ckpt3.lr_factor(s) for s in (7, 8, 9)] == [0.75, 1.0, 1.0]
    assert loader3.skip == [(6, 9)] and loader3.position == 12
    assert loader3.skipped == [(6, 9)]


def test_saved_lr_schedule_resumes_mid_ramp(tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path)
    ckpt.save(0)
    _, _, _, ckpt2 = make(tmp_path)
    ckpt2.resume(ResumePlan(lr=LRSchedule(0.2, steps=10, ramp_steps=10)))
    ckpt2.save(12)
    _, _, _, ckpt3 = make(tmp_path)
    ckpt3.resume(None)  # a crash restart with no plan: the schedule goes on from step 12
    assert [ckpt3.lr_factor(s) for s in (12, 19, 20)] == [ckpt2.lr_factor(s)
                                                           for s in (12, 19, 20)]
    assert ckpt3.lr_factor(12) == pytest.approx(0.2 + 0.8 * 3 / 10)


@pytest.mark.parametrize("iter_first", [False, True], ids=["resume-then-iter", "iter-then-resume"])
def test_iterating_a_restored_loader_leaves_the_global_rngs_as_resume_left_them(
        tmp_path: Path, iter_first: bool) -> None:
    """After ``resume()`` restored the RNGs, nothing of trainwarden draws from them: the
    first ``next()`` starts the loader (a DataLoader draws a base seed from the global
    torch RNG unless it has a generator of its own), and every dropout mask after a resume
    would be shifted by that draw."""
    model, opt, loader, ckpt = make(tmp_path)
    train(model, opt, iter(loader), 3)
    ckpt.save(3)
    _, _, loader2, ckpt2 = make(tmp_path)
    batches = iter(loader2) if iter_first else None
    ckpt2.resume(None)
    restored = global_rng()
    if batches is None:
        batches = iter(loader2)
    assert global_rng() == restored
    assert next(batches).index == 3
    assert global_rng() == restored
    next(batches)
    assert global_rng() == restored


def test_a_plan_left_by_an_earlier_run_of_the_name_never_loads_its_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second run with a reused name must not resume from the first run's checkpoint
    directory through a resume plan handed to it: the plan is refused, whether its directory
    is a sibling or merely shares the name's prefix, and nothing is loaded."""
    first, second = tmp_path / "first" / "ckpt", tmp_path / "second" / "ckpt"
    prefix = tmp_path / "second" / "ckpt-old"  # "second/ckpt" is a string prefix of it
    for root in (first, prefix):
        _, _, _, old = make(root)
        old.save(50)
    model, _, _, ckpt = make(second)
    before = [p.detach().clone() for p in model.parameters()]
    for named in (first / "step_50", prefix / "step_50"):
        plan = tmp_path / "plan.json"
        plan.write_text(ResumePlan(checkpoint=str(named), attempt=1).to_json())
        monkeypatch.setenv("TRAINWARDEN_RESUME_PLAN", str(plan))
        with pytest.raises(ValueError, match=r"is not inside this run.s checkpoint directory"):
            ckpt.resume()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert ckpt.resumed_from is None


class RecordingReporter(Reporter):
    """The checkpoint reports the worker would send, as they were made."""

    def __init__(self) -> None:
        super().__init__("")
        self.checkpoints: list[dict[str, object]] = []

    def checkpoint(self, **kw: object) -> bool:  # type: ignore[override]
        self.checkpoints.append(kw)
        return True


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_reports_how_long_it_blocked_the_training_loop(tmp_path: Path,
                                                              async_save: bool) -> None:
    """``stall_s`` is the time ``save`` held the loop: all of a synchronous save, the
    staging of an asynchronous one (never more than the whole save)."""
    rep = RecordingReporter()
    model, opt, loader, ckpt = make(tmp_path, async_save=async_save, reporter=rep)
    train(model, opt, iter(loader), 2)
    t0 = time.monotonic()
    ckpt.save(2)
    held = time.monotonic() - t0
    ckpt.wait()
    [report] = rep.checkpoints
    stall, save = report["stall_s"], report["save_s"]
    assert isinstance(stall, float) and isinstance(save, float)
    assert report["async_save"] is async_save
    assert 0 < stall <= held
    if async_save:
        assert stall <= save
    else:
        assert stall == save


# ---- across world sizes of one declared world ------------------------------------------------
def train_parts(model, opt, batches, n: int) -> None:  # type: ignore[no-untyped-def]
    for _ in range(n):
        for part in next(batches).parts(model):
            x, y = part.data
            part.weighted(torch.nn.functional.mse_loss(model(x), y)).backward()
        opt.step()
        opt.zero_grad()


def _set_meta(path: Path, **fields: object) -> None:
    meta = read_meta(path)
    meta.update(fields)
    for k, v in fields.items():
        if v is None:
            del meta[k]
    (path / "trainwarden.json").write_text(json.dumps(meta))


def test_the_declared_world_is_recorded_and_a_checkpoint_of_more_ranks_loads(
        tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path, declared=2)
    assert ckpt.declared_world_size == 2
    batches = iter(loader)
    train_parts(model, opt, batches, 3)
    ckpt.save(3)
    meta = read_meta(tmp_path / "step_3")
    assert (meta["world_size"], meta["declared_world_size"]) == (1, 2)
    _set_meta(tmp_path / "step_3", world_size=2)  # as if two ranks wrote it
    _, _, loader2, ckpt2 = make(tmp_path, declared=2)
    assert ckpt2.resume(None).start_step == 3
    assert next(iter(loader2)).index == 3 == next(batches).index


def test_a_checkpoint_of_another_declared_world_is_refused_naming_the_fix(
        tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path, declared=2)
    train_parts(model, opt, iter(loader), 1)
    ckpt.save(1)
    _, _, _, ckpt2 = make(tmp_path)
    with pytest.raises(ValueError, match=r"written by a run declaring 2 ranks .* this run "
                                         r"declares 1: resuming would change the global batch; "
                                         r"resume with TRAINWARDEN_DECLARED_WORLD_SIZE=2"):
        ckpt2.resume(None)


def test_a_checkpoint_without_a_declared_world_was_written_on_its_full_world(
        tmp_path: Path) -> None:
    model, opt, loader, ckpt = make(tmp_path)
    train(model, opt, iter(loader), 1)
    ckpt.save(1)
    _set_meta(tmp_path / "step_1", declared_world_size=None)
    assert make(tmp_path)[3].resume(None).start_step == 1
    with pytest.raises(ValueError, match="declaring 1 ranks"):
        make(tmp_path, declared=2)[3].resume(None)


def test_a_rank_the_checkpoint_holds_nothing_of_takes_rank_0s_position_and_keeps_its_rng(
        tmp_path: Path) -> None:
    """Growing back: the checkpoint was written by fewer ranks than now run."""
    model, opt, loader, ckpt = make(tmp_path, declared=2)
    train_parts(model, opt, iter(loader), 4)
    torch.manual_seed(7)
    ckpt.save(4)
    _, _, loader2, ckpt2 = make(tmp_path, declared=2)
    ckpt2.rank = 1  # a second rank of the grown world: no key of its own in step_4
    torch.manual_seed(99)
    seeded = global_rng()
    assert ckpt2.load(tmp_path / "step_4")["step"] == 4
    assert global_rng() == seeded
    assert loader2.position == 4


def _flip_one_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10  # the same size: only the checksum can tell
    f.write_bytes(bytes(data))


def test_a_file_corrupted_on_disk_is_refused_by_name_and_the_previous_checkpoint_loaded(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """(e) Each saved file's SHA-256 is recorded with the checkpoint and verified before a
    load: a shard corrupted on disk (its size intact, so the completeness check passes) is
    refused with a message naming the file, and the checkpoint before it is loaded, whether
    the newest is resumed or a plan names it."""
    model, opt, loader, ckpt = make(tmp_path, keep=5)
    batches = iter(loader)
    train(model, opt, batches, 2)
    ckpt.save(2)
    saved = [p.detach().clone() for p in model.parameters()]
    train(model, opt, batches, 2)
    ckpt.save(4)
    files = read_meta(tmp_path / "step_4")["files"]
    assert set(files) == {".metadata", "__0_0.distcp"}
    shard = tmp_path / "step_4" / "__0_0.distcp"
    _flip_one_byte(shard)
    assert validate_checkpoint(tmp_path / "step_4").ok  # complete, but corrupt
    sent: list[dict] = []
    for plan in (None, ResumePlan(checkpoint=str(tmp_path / "step_4"))):
        model2, _, _, ckpt2 = make(tmp_path, keep=5)
        ckpt2.reporter.event = lambda name, msg, **kw: sent.append(  # type: ignore[method-assign]
            {"name": name, "message": msg, **kw}) or True
        with caplog.at_level(logging.WARNING, logger="trainwarden"):
            info = ckpt2.resume(plan)
        assert info.start_step == 2 and info.checkpoint == tmp_path / "step_2"
        assert [p for p, _ in info.passed_over] == [tmp_path / "step_4"]
        for a, b in zip(model2.parameters(), saved, strict=True):
            assert torch.equal(a, b)
    assert f"file {shard} is corrupted" in caplog.text
    skipped = [e for e in sent if e["name"] == "checkpoint_skipped"]
    assert len(skipped) == 2 and str(shard) in skipped[0]["message"]
    # Nothing to fall back on: refused, with the reason.
    _flip_one_byte(tmp_path / "step_2" / ".metadata")
    _, _, _, ckpt3 = make(tmp_path, keep=5)
    with pytest.raises(ValueError, match=r"step_4, which is not to be loaded \(file .* is "
                                         r"corrupted"):
        ckpt3.resume(ResumePlan(checkpoint=str(tmp_path / "step_4")))


def test_a_checkpoint_saved_after_the_replicas_disagreed_is_never_loaded(
        tmp_path: Path) -> None:
    """The replicas' verdict is recorded with each checkpoint (``replicas``): one saved at or
    after their first disagreement (``agree: false``) is passed over on resume."""
    _, _, _, ckpt = make(tmp_path, keep=5)
    ckpt.save(2)
    ckpt.save(4)
    meta = read_meta(tmp_path / "step_4")
    meta["replicas"] = {"agree": False, "step": 4, "first_disagreement": 3}
    (tmp_path / "step_4" / "trainwarden.json").write_text(json.dumps(meta))
    _, _, _, ckpt2 = make(tmp_path, keep=5)
    info = ckpt2.resume(None)
    assert info.start_step == 2
    ((path, why),) = info.passed_over
    assert path == tmp_path / "step_4" and "replicas' parameter fingerprints disagreed" in why

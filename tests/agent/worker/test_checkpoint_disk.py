"""A save that fails on its disk (full, read-only) never ends training: the partial save is
removed, the failure reported once with its errno, path and free bytes, the last good
checkpoint kept, and the next save after the room came back completes.  On a real small
tmpfs (``tests.smallfs``: root only, skipped elsewhere saying why)."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from tests.agent.worker.test_checkpoint import make, train
from tests.smallfs import fill, remount, tmpfs
from trainwarden.agent.protocol import WorkerEventName
from trainwarden.agent.worker import list_checkpoints
from trainwarden.agent.worker.checkpoint import PARTIAL_SUFFIX
from trainwarden.agent.worker.report import Reporter
from trainwarden.agent.worker.save_failure import SaveFailureReason, analyse

pytestmark = pytest.mark.usefixtures("world1")


class Events(Reporter):
    """The events and checkpoint reports the worker would send."""

    def __init__(self) -> None:
        super().__init__("")
        self.events: list[dict[str, Any]] = []
        self.checkpoints: list[dict[str, Any]] = []

    def event(self, name: str, message: str = "", *, step: int | None = None,  # type: ignore[override]
              details: dict[str, Any] | None = None, blocking: bool = False) -> bool:
        self.events.append({"name": name, "message": message, "step": step,
                            "details": details or {}})
        return True

    def checkpoint(self, **kw: Any) -> bool:  # type: ignore[override]
        self.checkpoints.append(kw)
        return True

    def failed(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["name"] == WorkerEventName.CHECKPOINT_FAILED]


def steps_on_disk(root: Path) -> list[int]:
    return [c.step for c in list_checkpoints(root) if c.complete]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_full_disk_fails_the_save_not_training_and_saves_resume_when_room_returns(
        tmp_path: Path, async_save: bool) -> None:
    rep = Events()
    with tmpfs(tmp_path / "fs", "1m") as fs:
        root = fs / "ck"
        model, opt, loader, ckpt = make(root, reporter=rep, async_save=async_save,
                                        retention_grace_s=0)
        batches = iter(loader)
        train(model, opt, batches, 2)
        assert ckpt.save(2) is True
        ckpt.wait()
        filler = fill(fs, leave=2048)
        train(model, opt, batches, 2)
        ckpt.save(4)  # no exception: training goes on
        ckpt.wait()
        [ev] = rep.failed()
        d = ev["details"]
        assert ev["step"] == 4
        assert ev["message"].startswith("checkpoint disk full on node ")
        assert str(root) in ev["message"] and "step_2" in ev["message"]
        assert d["reason"] == SaveFailureReason.DISK_FULL and d["path"] == str(root / "step_4")
        assert d["free_bytes"] is not None and d["free_bytes"] < 64 * 1024
        assert d["total_bytes"] == 1 << 20
        assert d["last_good"] == str(root / "step_2")
        # The partial save is gone, the last good checkpoint is whole.
        assert not list(root.glob(f"*{PARTIAL_SUFFIX}"))
        assert steps_on_disk(root) == [2]
        # Still full: fails again, reported again (the exposure grows), nothing else moves.
        train(model, opt, batches, 2)
        ckpt.save(6)
        ckpt.wait()
        assert [e["step"] for e in rep.failed()] == [4, 6]
        assert rep.failed()[-1]["details"]["failed_saves"] == 2
        assert steps_on_disk(root) == [2]
        # Room again: the next save completes by itself.
        filler.unlink()
        train(model, opt, batches, 2)
        assert ckpt.save(8) is True
        ckpt.wait()
        assert steps_on_disk(root) == [2, 8]
        assert [c["step"] for c in rep.checkpoints] == [2, 8]
        assert ckpt.failed_saves == 0
        del ckpt


def test_a_read_only_file_system_fails_the_save_with_erofs(tmp_path: Path) -> None:
    rep = Events()
    with tmpfs(tmp_path / "fs", "1m") as fs:
        root = fs / "ck"
        model, opt, loader, ckpt = make(root, reporter=rep)
        batches = iter(loader)
        train(model, opt, batches, 2)
        ckpt.save(2)
        remount(fs, "ro")
        try:
            train(model, opt, batches, 2)
            assert ckpt.save(4) is False
        finally:
            remount(fs, "rw")
        [ev] = rep.failed()
        assert ev["details"]["reason"] == SaveFailureReason.READ_ONLY
        assert ev["details"]["errno"] == errno.EROFS
        assert ev["details"]["errno_name"] == "EROFS"
        assert ev["message"].startswith("checkpoint file system read-only on node ")
        train(model, opt, batches, 2)
        assert ckpt.save(6) is True
        assert steps_on_disk(root) == [2, 6]


def test_retention_frees_what_it_may_but_never_the_last_good_checkpoint(
        tmp_path: Path) -> None:
    """keep=1: after a failed save the surplus checkpoints (past their grace) go, the newest
    complete one and a pinned one stay."""
    rep = Events()
    with tmpfs(tmp_path / "fs", "1m") as fs:
        root = fs / "ck"
        now = [0.0]
        model, opt, loader, ckpt = make(root, reporter=rep, keep=1, retention_grace_s=10,
                                        clock=lambda: now[0])
        batches = iter(loader)
        for step in (2, 4, 6):
            train(model, opt, batches, 2)
            ckpt.save(step)
        ckpt.pin(2, "before an incident")
        assert steps_on_disk(root) == [2, 4, 6]  # step_4 is surplus, in its grace
        fill(fs, leave=2048)
        now[0] = 11.0
        train(model, opt, batches, 2)
        assert ckpt.save(8) is False
        assert steps_on_disk(root) == [2, 6]


def test_a_short_write_without_errno_on_a_full_disk_is_a_full_disk(tmp_path: Path) -> None:
    """torch.save's zip writer reports ENOSPC as "unexpected pos" (no errno): a short write,
    as is any failure with no room left; DCP's exception carries every rank's failure, the
    errno of any rank names the reason."""
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    e = CheckpointException("CheckpointException ranks:dict_keys([0, 1])",
                            {0: (short, []), 1: (OSError(28, "No space left on device"), [])})
    f = analyse(e, rank=1, root=tmp_path)
    assert (f.reason, f.errno, f.ranks, f.reporter) == (SaveFailureReason.DISK_FULL, 28,
                                                        (0, 1), 0)
    assert f.error == "OSError: [Errno 28] No space left on device"
    only_short = CheckpointException("x", {0: (short, [])})
    assert analyse(only_short, rank=0, root=tmp_path).reason == SaveFailureReason.DISK_FULL
    other = CheckpointException("x", {0: (RuntimeError("something else"), [])})
    assert analyse(other, rank=0, root=tmp_path).reason == SaveFailureReason.OTHER
    with tmpfs(tmp_path / "fs", "1m") as fs:
        fill(fs)
        assert analyse(other, rank=0, root=fs / "ck").reason == SaveFailureReason.DISK_FULL

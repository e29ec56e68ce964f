"""A Lightning run shrinks to fewer ranks and grows back under real torchrun (gloo on CPU):
the global batch of the declared world is kept, every global batch is trained exactly once,
and the result is the full-world run's.

Two ranks declared; on one rank the callback doubles ``accumulate_grad_batches`` and the rank
trains both ranks' micro-batches of each global batch, each loss divided by 2 (Lightning's
normalisation), as DDP averages two ranks' gradients: halving is exact in floating point, so
without dropout the weights end bit for bit as the clean two-rank run's.  The resizes fall on
step 9, where the restored loop progress of the old accumulation (9 micro-batches on two
ranks) is not a whole number of the new one's steps.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.torchrun import RunResult, run_example, trained, worker_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

SCRIPT = "lightning_module.py"
STEPS = 24
SHRINK_AT, GROW_AT = 9, 18  # checkpoints (every 3 steps); a launch stops there
COMMON = ("--checkpoint-every-steps", "3", "--seed", "3", "--hidden", "32", "--dropout", "0",
          "--retention-grace", "0")


def launch(workdir: Path, ckpt: Path, *, nproc: int, steps: int) -> RunResult:
    """One start of the example, on ``nproc`` ranks of a run declaring two, into ``ckpt``."""
    workdir.mkdir()
    r = run_example(SCRIPT, workdir, *COMMON, "--steps", str(steps), "--checkpoint-dir",
                    str(ckpt), nproc=nproc,
                    env=worker_env(TRAINWARDEN_DECLARED_WORLD_SIZE="2"))
    assert r.returncode == 0, r.output[-3000:]
    assert r.summary is not None
    assert (r.summary["world_size"], r.summary["declared_world_size"],
            r.summary["accumulate_grad_batches"]) == (nproc, 2, 2 // nproc)
    return r


def test_two_ranks_shrink_to_one_grow_back_and_end_as_the_full_world(tmp_path: Path) -> None:
    clean = launch(tmp_path / "clean", tmp_path / "clean-ck", nproc=2, steps=STEPS)
    ck = tmp_path / "ck"
    two = launch(tmp_path / "two", ck, nproc=2, steps=SHRINK_AT)
    one = launch(tmp_path / "one", ck, nproc=1, steps=GROW_AT)
    back = launch(tmp_path / "back", ck, nproc=2, steps=STEPS)
    assert one.summary is not None and back.summary is not None
    assert clean.summary is not None
    assert one.summary["started_at_step"] == SHRINK_AT
    assert back.summary["started_at_step"] == GROW_AT
    assert one.summary["resumed_from"].endswith(f"step_{SHRINK_AT}/checkpoint.ckpt")
    assert back.summary["resumed_from"].endswith(f"step_{GROW_AT}/checkpoint.ckpt")
    assert "holds no state of rank 1" in back.output
    # Every global batch 0..STEPS-1 exactly once, at its step: none lost, none doubled.
    assert trained([two, one, back]) == [(s, s) for s in range(STEPS)]
    assert trained([clean]) == [(s, s) for s in range(STEPS)]
    assert back.summary["weights_sha256"] == clean.summary["weights_sha256"]
    assert back.summary["final_eval_loss"] == clean.summary["final_eval_loss"]
    train, ref = back.summary["final_train_loss"], clean.summary["final_train_loss"]
    assert abs(train - ref) <= 1e-6 * abs(ref), (train, ref)

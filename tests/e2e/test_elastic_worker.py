"""A run shrinks to fewer ranks and grows back under real torchrun (gloo on CPU): the global
batch of the declared world is kept, every global batch is trained exactly once, and the
result is the full-world run's.

Two ranks declared; on one rank the example trains both micro-batch slots of each global
batch, each loss weighted 1/2.  Halving is exact in floating point and two ranks' gradients
are combined as g0/2 + g1/2 either way, so with DDP and with FSDP2 the weights end bit for bit
as the clean two-rank run's (the tests assert it for this configuration; other ratios are only
as close as a different summation order allows).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.torchrun import RunResult, run_example, trained, worker_env

pytestmark = pytest.mark.e2e

STEPS = 24
RESIZE_AT = 12  # a checkpoint (every 4 steps); the first launch stops there
COMMON = ("--checkpoint-every-steps", "4", "--seed", "3", "--hidden", "64")
DECLARED = "2"


def launch(script: str, workdir: Path, ckpt: Path, *, nproc: int, steps: int) -> RunResult:
    """One start of the example, on ``nproc`` ranks of a run declaring two, into ``ckpt``."""
    workdir.mkdir()
    r = run_example(script, workdir, *COMMON, "--steps", str(steps), "--checkpoint-dir",
                    str(ckpt), nproc=nproc,
                    env=worker_env(TRAINWARDEN_DECLARED_WORLD_SIZE=DECLARED))
    assert r.returncode == 0, r.output[-3000:]
    assert r.summary is not None
    assert (r.summary["world_size"], r.summary["declared_world_size"]) == (nproc, 2)
    return r


def check_lineage(lineage: list[RunResult], clean: RunResult) -> None:
    first, last = lineage[0], lineage[-1]
    assert first.summary is not None and last.summary is not None
    assert clean.summary is not None
    assert last.summary["started_at_step"] == RESIZE_AT
    assert last.summary["resumed_from"].endswith(f"step_{RESIZE_AT}")
    # Every global batch 0..STEPS-1 exactly once, at its step: none lost, none doubled.
    assert trained(lineage) == [(s, s) for s in range(STEPS)]
    assert trained([clean]) == [(s, s) for s in range(STEPS)]
    train, ref = last.summary["final_train_loss"], clean.summary["final_train_loss"]
    assert abs(train - ref) <= 0.01 * abs(ref), (train, ref)
    assert last.summary["weights_sha256"] == clean.summary["weights_sha256"]
    assert last.summary["final_eval_loss"] == clean.summary["final_eval_loss"]


@pytest.fixture(scope="module", params=["train_ddp.py", "train_fsdp.py"])
def clean(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
          ) -> tuple[str, RunResult]:
    script: str = request.param
    base = tmp_path_factory.mktemp("clean")
    return script, launch(script, base / "run", base / "ck", nproc=2, steps=STEPS)


def test_two_ranks_shrink_to_one_and_finish_as_the_full_world_would(
        clean: tuple[str, RunResult], tmp_path: Path) -> None:
    script, reference = clean
    ck = tmp_path / "ck"
    full = launch(script, tmp_path / "two", ck, nproc=2, steps=RESIZE_AT)
    shrunk = launch(script, tmp_path / "one", ck, nproc=1, steps=STEPS)
    check_lineage([full, shrunk], reference)


def test_one_rank_grows_back_to_two_and_finishes_as_the_full_world_would(
        clean: tuple[str, RunResult], tmp_path: Path) -> None:
    """The second rank finds no state of its own in a one-rank checkpoint: it continues at
    rank 0's global batch, its RNG as seeded (these examples draw nothing random)."""
    script, reference = clean
    ck = tmp_path / "ck"
    shrunk = launch(script, tmp_path / "one", ck, nproc=1, steps=RESIZE_AT)
    grown = launch(script, tmp_path / "two", ck, nproc=2, steps=STEPS)
    assert "holds no state of rank 1" in grown.output
    check_lineage([shrunk, grown], reference)

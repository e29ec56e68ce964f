"""A rank killed with SIGKILL under torchrun resumes to the very same result."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.torchrun import effective_history, run_example

pytestmark = pytest.mark.e2e

STEPS = 160
CRASH_AT = 113  # between the checkpoints at 100 and 125


@pytest.mark.parametrize("script", ["train_ddp.py", "train_fsdp.py"])
def test_sigkilled_rank_resumes_bit_identical(script: str, tmp_path: Path) -> None:
    common = ["--steps", str(STEPS), "--checkpoint-every-steps", "25", "--seed", "3",
              "--hidden", "64"]
    clean_dir, crash_dir = tmp_path / "clean", tmp_path / "crash"
    clean_dir.mkdir()
    crash_dir.mkdir()
    clean = run_example(script, clean_dir, *common, "--checkpoint-dir", str(clean_dir / "ck"))
    assert clean.returncode == 0, clean.output[-3000:]
    crashed = run_example(script, crash_dir, *common, "--checkpoint-dir", str(crash_dir / "ck"),
                          "--inject", f"crash@{CRASH_AT}:rank=1", max_restarts=1)
    assert crashed.returncode == 0, crashed.output[-3000:]

    # The crash really happened, and the second start resumed from the newest complete one.
    assert "exitcode: -9" in crashed.output, crashed.output[-3000:]
    assert crashed.summary is not None and clean.summary is not None
    assert crashed.summary["resumed_from"].endswith("step_100")
    assert crashed.summary["started_at_step"] == 100

    # Same weights, bit for bit, and the same losses.
    assert crashed.summary["weights_sha256"] == clean.summary["weights_sha256"]
    assert crashed.summary["final_eval_loss"] == clean.summary["final_eval_loss"]

    for rank in (0, 1):
        rows = crashed.batch_log[rank]
        starts = sorted({a for a, *_ in rows})
        assert starts == ["0.0", "0.1"], starts
        first = [r for r in rows if r[0] == "0.0"]
        second = [r for r in rows if r[0] == "0.1"]
        # Only the steps after the checkpoint were trained twice, each exactly twice.
        redone = sorted({s for _, s, _, _ in first} & {s for _, s, _, _ in second})
        assert redone == list(range(100, redone[-1] + 1))
        assert redone[-1] >= CRASH_AT - 1 or rank == 1
        # The history the final weights saw: every step once, batch indices with no gap and no
        # duplicate, identical to the uninterrupted run's.
        hist = effective_history(rows)
        assert sorted(hist) == list(range(STEPS))
        indices = [hist[s] for s in range(STEPS)]
        assert indices == list(range(STEPS))
        assert effective_history(clean.batch_log[rank]) == hist

"""A rank killed with SIGKILL under torchrun resumes to the very same result."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.e2e.torchrun import (
    REPO,
    TORCHRUN,
    RunResult,
    effective_history,
    run_example,
    worker_env,
)

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


README = REPO / "README.md"
README_SCRIPT = Path(__file__).with_name("readme_train.py")
# The one line of the README's loop the script changes: checkpoints on a test run's time scale.
README_CHANGED = {"interval_s=600,": "interval_s=args.checkpoint_every,"}


def readme_loop() -> list[str]:
    """The code lines of the README's "3. Add a few lines to train.py" block."""
    text = README.read_text()
    section = text[text.index("### 3. Add a few lines to train.py"):]
    block = section[section.index("```python\n") + len("```python\n"):]
    lines = [line.rstrip() for line in block[:block.index("```")].splitlines()]
    for old, new in README_CHANGED.items():
        lines = [line.replace(old, new) for line in lines]
    return [line for line in lines if line.strip()]


def test_the_readme_script_holds_the_readme_loop_line_for_line() -> None:
    """What the resume test below runs is the README's loop: every line of it, in order."""
    script = [line.rstrip() for line in README_SCRIPT.read_text().splitlines()]
    pos = 0
    for line in readme_loop():
        assert line in script[pos:], f"README line missing from {README_SCRIPT.name}: {line!r}"
        pos = script.index(line, pos) + 1


def run_readme_script(workdir: Path, wrap: str, *args: str, max_restarts: int = 0
                      ) -> RunResult:
    workdir.mkdir()
    summary = workdir / "summary.json"
    cmd = [TORCHRUN, "--nproc_per_node=2", "--standalone", f"--max-restarts={max_restarts}",
           "--monitor-interval=0.1", str(README_SCRIPT), "--wrap", wrap, "--steps", "160",
           "--seed", "4", "--checkpoint-dir", str(workdir / "ck"),
           "--summary-json", str(summary), *args]
    proc = subprocess.run(cmd, cwd=workdir, env=worker_env(), capture_output=True, text=True,
                          timeout=240)
    return RunResult(proc.returncode, proc.stdout + proc.stderr,
                     json.loads(summary.read_text()) if summary.exists() else None, {})


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_readme_loop_with_dropout_and_random_augmentation_resumes_bit_identical(
        wrap: str, tmp_path: Path) -> None:
    """Dropout, input noise (torch), a random crop (Python) and noise (NumPy) all draw from
    the global RNGs after resume() restored them; a rank SIGKILLed a few steps after the first
    (time-based) checkpoint resumes from the newest checkpoint and ends with the uninterrupted
    run's weights, bit for bit."""
    clean = run_readme_script(tmp_path / "clean", wrap)
    assert clean.returncode == 0, clean.output[-3000:]
    crashed = run_readme_script(tmp_path / "crash", wrap, "--kill-after-checkpoint", "5",
                                max_restarts=1)
    assert crashed.returncode == 0, crashed.output[-3000:]
    assert "exitcode: -9" in crashed.output, crashed.output[-3000:]
    assert clean.summary is not None and crashed.summary is not None
    assert clean.summary["model_class"] == {"ddp": "DistributedDataParallel",
                                            "fsdp": "FSDPNet"}[wrap]
    assert clean.summary["started_at_step"] == 0
    assert crashed.summary["started_at_step"] > 0, crashed.summary  # from a checkpoint
    assert crashed.summary["weights_sha256"] == clean.summary["weights_sha256"]
    assert crashed.summary["final_loss"] == clean.summary["final_loss"]

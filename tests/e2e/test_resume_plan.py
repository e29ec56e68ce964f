"""A resume plan (checkpoint, skip ranges, LR schedule) applied by a real torchrun run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.torchrun import effective_history, run_example, worker_env
from tests.wire import Receiver

pytestmark = pytest.mark.e2e

LR = 2e-3


def test_plan_skips_batches_and_follows_the_lr_schedule(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    first = run_example("train_ddp.py", tmp_path, "--steps", "60", "--checkpoint-every-steps",
                        "20", "--hidden", "32", "--lr", str(LR), "--checkpoint-dir", str(ck),
                        "--keep", "5")
    assert first.returncode == 0, first.output[-3000:]

    # Roll back to step 20, skip global batches 25-39 and 50-54, LR x0.25 for 10 steps then
    # back over 4 steps.
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"checkpoint": str(ck / "step_20"), "skip": [[25, 39], [50, 54]],
                                "lr": {"scale": 0.25, "steps": 10, "ramp_steps": 4},
                                "reason": "test rollback", "attempt": 1}))
    agent = Receiver(tmp_path / "agent.sock")
    try:
        env = worker_env(TRAINWARDEN_RESUME_PLAN=str(plan), TRAINWARDEN_AGENT_SOCKET=agent.path,
                       TRAINWARDEN_ATTEMPT="1")
        second = run_example("train_ddp.py", tmp_path, "--steps", "60",
                             "--checkpoint-every-steps", "20", "--hidden", "32", "--lr", str(LR),
                             "--checkpoint-dir", str(ck), "--keep", "5", env=env)
    finally:
        agent.close()
    assert second.returncode == 0, second.output[-3000:]
    assert second.summary is not None
    assert second.summary["started_at_step"] == 20
    assert second.summary["skipped"] == [[25, 39], [50, 54]]

    for rank in (0, 1):
        rows = [r for r in second.batch_log[rank] if r[0] == "1.0"]
        trained = [index for _, _, index, _ in rows]
        assert [s for _, s, _, _ in rows] == list(range(20, 60))
        # The skipped indices are never trained; everything else in order, nothing twice.
        assert trained == [*range(20, 25), *range(40, 50), *range(55, 80)]
        lrs = [lr for *_, lr in rows]
        expected = [LR * 0.25] * 10 + [LR * f for f in (0.4375, 0.625, 0.8125, 1.0)] + [LR] * 26
        assert lrs == pytest.approx(expected)
        assert effective_history(second.batch_log[rank])[19] == 19  # before the rollback

    # What the workers told the agent: the resume, the skips, and every step from both ranks.
    resumed = agent.of("event", "resumed")
    assert len(resumed) == 1 and resumed[0]["details"]["step"] == 20
    assert resumed[0]["details"]["checkpoint"].endswith("step_20")
    assert agent.of("event", "batches_skipped")
    steps = agent.of("step")
    assert {(m["rank"], m["step"]) for m in steps} == {(r, s) for r in (0, 1)
                                                       for s in range(20, 60)}
    assert all(m["attempt"] == 1 and m["compute_s"] is not None for m in steps)
    saved = [m for m in agent.of("checkpoint")]
    assert [m["step"] for m in saved] == [40, 60]

    # The checkpoint written after the rollback keeps the skip list for later restarts.
    meta = json.loads((ck / "step_40" / "trainwarden.json").read_text())
    assert meta["skip"] == [[25, 39], [50, 54]] and meta["attempt"] == 1
    assert meta["resumed_from"].endswith("step_20")

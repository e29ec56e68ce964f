"""A stuck peer makes the collective time out; the waiting rank reports it before exiting."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.torchrun import run_example, worker_env
from tests.wire import Receiver

pytestmark = pytest.mark.e2e


def test_collective_timeout_is_reported_with_rank_and_message(tmp_path: Path) -> None:
    agent = Receiver(tmp_path / "agent.sock")
    try:
        result = run_example("train_ddp.py", tmp_path, "--steps", "100", "--hidden", "32",
                             "--timeout", "3", "--inject", "hang@30:rank=1",
                             "--checkpoint-dir", str(tmp_path / "ck"),
                             env=worker_env(TRAINWARDEN_AGENT_SOCKET=agent.path), timeout=120)
    finally:
        agent.close()
    assert result.returncode != 0
    timeouts = agent.of("event", "collective_timeout")
    assert len(timeouts) == 1, [m for m in agent.messages if m["type"] == "event"]
    ev = timeouts[0]
    assert ev["rank"] == 0  # the rank that waited, not the one that hung
    assert "Timed out" in ev["message"] and "3000ms" in ev["message"]
    assert ev["details"]["collective"].startswith("all_reduce")
    # The last step rank 0 reported before it got stuck in step 30's gradient all-reduce.
    assert max(m["step"] for m in agent.of("step") if m["rank"] == 0) == 29

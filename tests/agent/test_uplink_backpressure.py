"""Backpressure: a supervisor that is behind asks for fewer, larger batches.  The real
``Uplink`` against the real supervisor (uvicorn on SQLite, the supervisor's clock in the
test's hands): batches that arrive 20 s after the agent made them put the supervisor
behind, and its replies ask the agent to batch every ``overload.batch_interval_s``; the
agent's loop then batches that often (events that cannot wait still go at once)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_fakes import AGENT_TOKEN, OPERATOR_TOKEN, SupervisorClock

from agent.config import AgentConfig
from agent.loop import Agent
from agent.uplink import MAX_ADVISED_INTERVAL_S, Uplink, advised_interval


def _send(up: Uplink, step: int, now: float | None = None) -> None:
    """Spool and send a batch made at ``now`` (the agent's clock: the real time)."""
    t = time.time() if now is None else now
    up.enqueue([{"type": "step", "attempt": 0, "rank": 0, "world_size": 1, "step": step,
                 "t": t, "loss": 1.0}],
               {"type": "heartbeat", "t": t, "attempt": 0, "state": "running"},
               attempt=0)
    up._next_try = 0.0  # no backoff wait in tests
    up.pump()


def test_a_supervisor_that_is_behind_asks_the_agent_for_fewer_batches(
        served_supervisor: tuple[str, SupervisorClock, Any], tmp_path: Path) -> None:
    base, clock, app = served_supervisor
    evaluator = app.state.evaluator
    (tmp_path / "agent").mkdir()
    up = Uplink(supervisor_url=base, token=AGENT_TOKEN, state_dir=tmp_path / "agent",
                register_request={"run": "bp", "node": "n0", "hostname": "h0"})
    for s in range(3):  # keeping up
        _send(up, s)
    evaluator.tick()
    _send(up, 3)
    assert up.advised_interval_s is None
    clock.now += 20.0  # from now on the agent's batches arrive 20 s after it sent them
    for s in range(4, 8):
        _send(up, s)
    evaluator.tick()
    assert evaluator.overload is not None
    _send(up, 8)
    assert up.advised_interval_s == evaluator.detection.overload.batch_interval_s
    assert up.advised_interval_s == 4.0  # the default
    assert up.sent == 9  # nothing was dropped
    run = httpx.get(f"{base}/api/v1/runs/bp", timeout=5,
                    headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}).json()
    assert run["step"] == 8
    clock.now += evaluator.detection.overload.backoff_hold_s + 1  # long after its last tick
    up.clock = clock  # (the agent's clock the supervisor's again: batches on time)
    for s in range(9, 12):
        _send(up, s, now=clock.now)
    evaluator.tick()
    _send(up, 12, now=clock.now)
    assert up.advised_interval_s is None  # back to the agent's own interval


@pytest.mark.parametrize(("value", "want"), [
    (4.0, 4.0), (2, 2.0), (0, None), (-1.0, None), (float("nan"), None), (True, None),
    ("4", None), (None, None), (1e9, MAX_ADVISED_INTERVAL_S)])
def test_only_a_sensible_advice_is_taken(value: Any, want: float | None) -> None:
    assert advised_interval(value) == want


def test_the_agent_batches_at_the_longer_of_its_interval_and_the_advice(
        tmp_path: Path) -> None:
    cfg = AgentConfig(supervisor_url="http://s", run="r", command=["true"],
                      state_dir=tmp_path, batch_interval_s=1.0)
    agent = Agent(cfg, transport=httpx.MockTransport(lambda r: httpx.Response(503)),
                  threaded_uplink=False, echo=False)
    try:
        assert agent.batch_interval_s() == 1.0
        agent.uplink.advised_interval_s = 4.0
        assert agent.batch_interval_s() == 4.0
        agent.uplink.advised_interval_s = 0.5  # never more often than its own
        assert agent.batch_interval_s() == 1.0
    finally:
        agent.close()

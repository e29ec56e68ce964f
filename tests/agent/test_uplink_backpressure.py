"""Backpressure: a supervisor that is behind asks for fewer, larger batches.  The real
``Uplink`` against the real supervisor (uvicorn on SQLite, the supervisor's clock in the
test's hands): batches that arrive 20 s after the agent made them put the supervisor
behind, and its replies ask the agent to batch every ``overload.batch_interval_s``; the
agent's loop then batches that often (events that cannot wait still go at once)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_fakes import AGENT_TOKEN, OPERATOR_TOKEN, SupervisorClock

from trainwarden.agent.config import AgentConfig
from trainwarden.agent.loop import Agent
from trainwarden.agent.uplink import MAX_ADVISED_INTERVAL_S, Uplink, advised_interval


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


class _AdvisingSupervisor:
    """A supervisor double for many agents: registers each, and from ``advise_from`` on
    (its clock) every ingest reply asks for ``advice`` second batches, as an overloaded
    supervisor's replies do.  Records when each batch arrived."""

    def __init__(self, clock: Callable[[], float], advise_from: float, advice: float) -> None:
        self.clock, self.advise_from, self.advice = clock, advise_from, advice
        self.arrivals: dict[int, list[float]] = {}
        self._ids = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/agents/register"):
            self._ids += 1
            return httpx.Response(200, json={
                "agent_id": self._ids, "run_id": 1, "run_uuid": "u-1", "attempt": 0,
                "next_seq": 0, "credential": f"c{self._ids}", "heartbeat_interval_s": 1.0})
        body = json.loads(request.content)
        now = self.clock()
        self.arrivals.setdefault(body["agent_id"], []).append(now)
        reply: dict[str, Any] = {"seq": body["seq"], "duplicate": False, "attempt": 0,
                                 "commands": [], "protect": []}
        if now >= self.advise_from:
            reply["batch_interval_s"] = self.advice
        return httpx.Response(200, json=reply)


def test_agents_told_to_batch_less_often_spread_their_batches_over_the_interval(
        tmp_path: Path) -> None:
    """40 agents on a 1 s cadence all read "batch every 4 s" in the same second (one
    overloaded supervisor answers them all): their batches must spread over the 4 s, about
    10 a second, not arrive together in one second out of four (a burst of 4x the rate the
    advice was sized for).  Their phases are spread here as the random ones are on
    average (the test of the default draw is below)."""
    n, advice, tick = 40, 4.0, 0.05
    t = [1000.0]
    sup = _AdvisingSupervisor(lambda: t[0], advise_from=1005.0, advice=advice)
    agents = [Agent(AgentConfig(supervisor_url="http://s", run="r", node=f"n{i}",
                                command=["true"], state_dir=tmp_path / f"a{i}",
                                batch_interval_s=1.0),
                    transport=httpx.MockTransport(sup.handler), clock=lambda: t[0],
                    threaded_uplink=False, echo=False, batch_phase=(i + 0.5) / n)
              for i in range(n)]
    try:
        while t[0] < 1030.0:
            for a in agents:
                a.tick()
            t[0] = round(t[0] + tick, 6)
    finally:
        for a in agents:
            a.close()
    assert len(sup.arrivals) == n
    settled = [x for times in sup.arrivals.values() for x in times if 1010.0 <= x < 1030.0]
    assert len(settled) == n * 20 / advice, "each agent batches every 4 s once told"
    per_second = Counter(int(x) for x in settled)
    assert max(per_second.values()) <= 1.5 * n / advice, sorted(per_second.items())
    assert len(per_second) == 20, "some second of the 20 got no batch at all"


def test_each_agent_draws_its_own_phase_of_the_interval(tmp_path: Path) -> None:
    phases = []
    for i in range(3):
        a = Agent(AgentConfig(supervisor_url="http://s", run="r", command=["true"],
                              state_dir=tmp_path / f"a{i}"),
                  transport=httpx.MockTransport(lambda r: httpx.Response(503)),
                  threaded_uplink=False, echo=False)
        phases.append(a.batch_phase)
        a.close()
    assert all(0.0 <= p < 1.0 for p in phases), phases
    assert len(set(phases)) == 3, phases

"""The agent's credential: the real ``Uplink`` against the real supervisor
(uvicorn on SQLite, the supervisor's clock in the test's hands).  The credential is kept in
the state dir, a restarted agent keeps its node by presenting it, an agent whose state was
lost waits until its old incarnation is called lost, and an agent taken over stops."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from agent_fakes import AGENT_TOKEN, OPERATOR_TOKEN, SupervisorClock

from trainwarden.agent.uplink import Uplink

OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


@pytest.fixture
def sup(served_supervisor: tuple[str, SupervisorClock, Any]
        ) -> tuple[str, SupervisorClock]:
    base, clock, _app = served_supervisor
    return base, clock


def _uplink(base: str, state: Path, host: str = "h0") -> Uplink:
    state.mkdir(parents=True, exist_ok=True)
    return Uplink(supervisor_url=base, token=AGENT_TOKEN, state_dir=state,
                  register_request={"run": "cred", "node": "n0", "hostname": host})


def _send(up: Uplink, step: int) -> None:
    up.enqueue([{"type": "step", "attempt": 0, "rank": 0, "world_size": 1, "step": step,
                 "t": time.time(), "loss": 1.0}],
               {"type": "heartbeat", "t": time.time(), "attempt": 0, "state": "running"},
               attempt=0)
    up._next_try = 0.0  # no backoff wait in tests
    up.pump()


def _run(base: str) -> Any:
    return httpx.get(f"{base}/api/v1/runs/cred", headers=OPERATOR, timeout=5).json()


def test_a_restarted_agent_keeps_its_node_with_the_credential_in_its_state(
        tmp_path: Path, sup: tuple[str, SupervisorClock]) -> None:
    base, clock = sup
    first = _uplink(base, tmp_path / "a")
    _send(first, 0)
    assert first.pending == 0
    saved = json.loads((tmp_path / "a" / "uplink.json").read_text())
    assert saved["credential"].startswith("twa_")
    first.close()
    clock.now += 2  # restarted at once: the node-lost deadline has not passed
    again = _uplink(base, tmp_path / "a")
    _send(again, 1)
    assert again.pending == 0 and again.refused is None
    assert again.agent_id == first.agent_id
    assert _run(base)["step"] == 1


def test_an_agent_with_a_lost_state_waits_for_its_old_incarnation_to_be_lost(
        tmp_path: Path, sup: tuple[str, SupervisorClock]) -> None:
    base, clock = sup
    _send(_uplink(base, tmp_path / "a"), 0)
    fresh = _uplink(base, tmp_path / "b", host="h1")
    _send(fresh, 0)
    assert fresh.registration is None and fresh.refused is None  # 409, retried later
    assert fresh.pending == 1
    clock.now += 31  # past the node-lost deadline: the old incarnation is dead
    fresh._next_try = 0.0
    fresh.pump()
    assert fresh.registration is not None and fresh.pending == 0
    assert _run(base)["agents"][0]["hostname"] == "h1"


def test_an_agent_taken_over_stops_sending_and_says_why(
        tmp_path: Path, sup: tuple[str, SupervisorClock]) -> None:
    base, _clock = sup
    old = _uplink(base, tmp_path / "a")
    _send(old, 0)
    r = httpx.post(f"{base}/api/v1/runs/cred/nodes/n0/takeover", headers=OPERATOR, timeout=5)
    assert r.status_code == 200, r.text
    new = _uplink(base, tmp_path / "b", host="h1")
    _send(new, 0)
    assert new.pending == 0
    _send(old, 1)  # 403 for the credential: registers again, told it was taken over
    old._next_try = 0.0
    old.pump()
    assert old.refused is not None and "taken over" in old.refused
    assert old.pending == 1  # nothing of the old agent's was stored
    assert _run(base)["agents"][0]["hostname"] == "h1"

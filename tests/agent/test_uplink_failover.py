"""An agent that knows several supervisor addresses (issue 13, item 2): the real ``Uplink``
against two real supervisor processes sharing one Postgres.  The first is killed; the batches
spooled meanwhile go to the second, in order, under the same registration and credential,
each stored once."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent.uplink import Uplink
from tests.e2e.system import AGENT_TOKEN, Supervisor, postgres_schema, wait_until

RUN = "failover"


@pytest.fixture
def replicas(tmp_path: Path, postgres_url: str) -> Iterator[tuple[Supervisor, Supervisor]]:
    with postgres_schema(postgres_url) as url:
        made = [Supervisor(tmp_path / name, None, "--db", url) for name in ("a", "b")]
        try:
            for sup in made:  # one after the other: the first creates the schema
                sup.start()
            yield made[0], made[1]
        finally:
            for sup in made:
                sup.stop()


def _enqueue(up: Uplink, step: int) -> None:
    up.enqueue([{"type": "step", "attempt": 0, "rank": 0, "world_size": 1, "step": step,
                 "t": time.time(), "loss": 1.0}],
               {"type": "heartbeat", "t": time.time(), "attempt": 0, "state": "running"},
               attempt=0)


def _deliver(up: Uplink) -> bool:
    up._next_try = 0.0  # no backoff wait in tests
    up.pump()
    return up.pending == 0


def _stored_steps(sup: Supervisor) -> list[int]:
    points = sup.get(f"/runs/{RUN}/steps?max_points=5000")["points"]
    return [p["step_from"] for p in points for _ in range(p["ranks"])]


def test_the_uplink_fails_over_to_the_next_replica_and_keeps_its_spool_order(
        tmp_path: Path, replicas: tuple[Supervisor, Supervisor]) -> None:
    a, b = replicas
    state = tmp_path / "agent"
    state.mkdir()
    up = Uplink(supervisor_url=f"{a.url},{b.url}", token=AGENT_TOKEN, state_dir=state,
                register_request={"run": RUN, "node": "n0", "hostname": "h0"})
    try:
        for s in range(5):
            _enqueue(up, s)
        assert _deliver(up)
        assert up.supervisor_url == a.url
        agent_id, credential = up.agent_id, up.credential
        a.kill()
        for s in range(5, 10):  # spooled while the first replica is dead
            _enqueue(up, s)
        wait_until(lambda: _deliver(up), 30, "the spooled batches to reach the second replica")
        assert up.supervisor_url == b.url
        # The same agent and credential: the registration lives in the shared store.
        assert (up.agent_id, up.credential) == (agent_id, credential)
        # Every step stored exactly once, none lost on the way.
        assert _stored_steps(b) == list(range(10))
    finally:
        up.close()


def test_the_uplink_comes_back_to_the_first_address_when_the_second_fails(
        tmp_path: Path, replicas: tuple[Supervisor, Supervisor]) -> None:
    a, b = replicas
    state = tmp_path / "agent"
    state.mkdir()
    # The second address first: killing it sends the uplink round to the first.
    up = Uplink(supervisor_url=[b.url, a.url], token=AGENT_TOKEN, state_dir=state,
                register_request={"run": RUN, "node": "n0", "hostname": "h0"})
    try:
        _enqueue(up, 0)
        assert _deliver(up)
        b.kill()
        _enqueue(up, 1)
        wait_until(lambda: _deliver(up), 30, "the batch to reach the other replica")
        assert up.supervisor_url == a.url
        assert _stored_steps(a) == [0, 1]
    finally:
        up.close()

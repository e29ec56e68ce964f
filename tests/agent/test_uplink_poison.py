"""No poison pill: the real ``Uplink`` against the real supervisor (the FastAPI app in a real
uvicorn server on SQLite), with one batch answered 500 every time and another 422.  Every
batch after them is stored, and the supervisor receives an event naming each batch set aside.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.dashboard.browser import serve_in_thread
from trainwarden.agent.uplink import Uplink
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.server.app import create_app

AGENT_TOKEN, OPERATOR_TOKEN = "agent-secret", "operator-secret"
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}


class FailSeqs:
    """ASGI wrapper in front of the real app: ``POST /api/v1/ingest`` of a batch whose seq is
    in ``fail`` is answered with that status (and never reaches the app); everything else
    passes through untouched.  ``seen`` counts the posts per seq."""

    def __init__(self, app: Any, fail: dict[int, int]) -> None:
        self.app, self.fail = app, fail
        self.seen: dict[int, int] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/api/v1/ingest":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            msg = await receive()
            chunks.append(msg.get("body", b""))
            more = msg.get("more_body", False)
        body = b"".join(chunks)
        seq = json.loads(body)["seq"]
        self.seen[seq] = self.seen.get(seq, 0) + 1
        if seq in self.fail:
            code = self.fail[seq]
            reply = json.dumps({"detail": f"injected {code} for seq {seq}"}).encode()
            await send({"type": "http.response.start", "status": code,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": reply})
            return
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if sent:
                return await receive()
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


class StepClock:
    """The uplink's clock: real time plus whatever the test skips (backoffs pass at once)."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.time() + self.skipped


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[tuple[str, FailSeqs]]:
    settings = SupervisorSettings(agent_token=AGENT_TOKEN, operator_token=OPERATOR_TOKEN,
                                  data_dir=tmp_path / "sup")
    (tmp_path / "sup").mkdir()
    wrapper = FailSeqs(create_app(settings), {3: 500, 6: 422})
    with serve_in_thread(wrapper) as base:
        yield base, wrapper


def step(s: int) -> dict[str, Any]:
    return {"type": "step", "attempt": 0, "rank": 0, "world_size": 1, "step": s,
            "t": time.time(), "loss": 1.0, "samples": 4}


def heartbeat() -> dict[str, Any]:
    return {"type": "heartbeat", "t": time.time(), "attempt": 0, "state": "running",
            "workers": []}


def test_one_bad_batch_never_blocks_the_rest(tmp_path: Path,
                                             supervisor: tuple[str, FailSeqs]) -> None:
    base, wrapper = supervisor
    clock = StepClock()
    up = Uplink(supervisor_url=base, token=AGENT_TOKEN, state_dir=tmp_path / "agent",
                register_request={"run": "poison", "node": "n0"}, clock=clock)
    (tmp_path / "agent").mkdir(exist_ok=True)
    for s in range(10):
        assert up.enqueue([step(s)], heartbeat(), attempt=0) == [s]

    def events() -> list[dict[str, Any]]:
        r = httpx.get(f"{base}/api/v1/runs/poison/events", headers=OPERATOR, timeout=5)
        return [e for e in r.json()["events"] if e["name"] == "batch_dead_lettered"] \
            if r.status_code == 200 else []

    # The agent's own rhythm: a pass, time goes on (backoffs pass), a heartbeat batch.
    for _ in range(40):
        up.pump()
        if up.pending == 0 and len(events()) == 2:
            break
        clock.skipped += 11.0  # longer than the longest backoff
        up.enqueue([], heartbeat(), attempt=0)
    try:
        r = httpx.get(f"{base}/api/v1/runs/poison/steps", headers=OPERATOR, timeout=5)
        stored = sorted(p["step_from"] for p in r.json()["points"])
        assert stored == [0, 1, 2, 4, 5, 7, 8, 9], "every step but the two bad batches' is stored"
        got = {e["details"]["seq"]: e for e in events()}
        assert sorted(got) == [3, 6], "one event per batch set aside reaches the supervisor"
        assert got[6]["details"]["status"] == 422
        assert got[3]["details"]["status"] == 500
        assert "injected 500 for seq 3" in got[3]["details"]["reason"]
        assert got[6]["details"]["count"] + got[3]["details"]["count"] == 3  # 1 then 2
        assert wrapper.seen[6] == 1, "a 4xx is final: never retried"
        assert 2 <= wrapper.seen[3] <= 8, "a 5xx is retried, a bounded number of times"
        # Both bad batches are kept, with the supervisor's reply, for a human to look at.
        dead = tmp_path / "agent" / "dead-letter"
        kept = sorted(p.name for p in dead.glob("*.json"))
        assert [n.split("-")[0] for n in kept] == ["000000000003", "000000000006"]
        assert "injected 422" in next(dead.glob("000000000006-*.reply.txt")).read_text()
        # Heartbeats went on: the node is alive to the supervisor.
        run = httpx.get(f"{base}/api/v1/runs/poison", headers=OPERATOR, timeout=5).json()
        assert time.time() - run["agents"][0]["last_seen_at"] < 30
    finally:
        up.close()


def test_a_seq_used_for_other_content_is_set_aside_and_the_rest_goes_on(
        tmp_path: Path, supervisor: tuple[str, FailSeqs]) -> None:
    """The supervisor answers 409 when a seq it stored comes again with different content
    (here: the agent's numbering went back, and seq 0 is spooled anew with other steps).  The
    batch can never be stored under that seq: it is set aside with the reply, announced, and
    the batches after it are delivered."""
    base, _wrapper = supervisor
    (tmp_path / "agent").mkdir()
    up = Uplink(supervisor_url=base, token=AGENT_TOKEN, state_dir=tmp_path / "agent",
                register_request={"run": "replay", "node": "n0"}, clock=StepClock())
    try:
        assert up.enqueue([step(0)], heartbeat(), attempt=0) == [0]
        up.pump()
        assert up.pending == 0
        up.spool.add({"seq": 0, "attempt": 0, "items": [step(100), heartbeat()]})
        assert up.enqueue([step(1)], heartbeat(), attempt=0) == [1]
        up.pump()
        assert up.pending == 0, "the refused batch does not stay in line"
        assert up.enqueue([step(2)], heartbeat(), attempt=0) == [2]  # carries the notice
        up.pump()
        r = httpx.get(f"{base}/api/v1/runs/replay/steps", headers=OPERATOR, timeout=5)
        assert sorted(p["step_from"] for p in r.json()["points"]) == [0, 1, 2]
        r = httpx.get(f"{base}/api/v1/runs/replay/events", headers=OPERATOR, timeout=5)
        [ev] = [e for e in r.json()["events"] if e["name"] == "batch_dead_lettered"]
        assert ev["details"]["seq"] == 0 and ev["details"]["status"] == 409
        dead = tmp_path / "agent" / "dead-letter"
        reply = next(dead.glob("000000000000-*.reply.txt")).read_text()
        assert reply.startswith("HTTP 409") and "already used for different content" in reply
    finally:
        up.close()

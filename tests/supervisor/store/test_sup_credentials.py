"""Per-agent credentials and node takeover: the agent token alone does not let one agent
speak for another.  A holder registered only on run B tries each way of speaking for run A's
agent: each attempt is 403 and stores nothing."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    AGENT,
    CREDENTIAL_HEADER,
    OPERATOR,
    FakeClock,
    count_rows,
    crash,
    ingest,
    register,
    step,
)
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store.db import Database

CFG = policy.PolicyConfig()


def _post(client: TestClient, agent_id: int, seq: int, items: list[dict[str, Any]],
          credential: str | None) -> Any:
    headers = {**AGENT, "content-type": "application/json"}
    if credential is not None:
        headers[CREDENTIAL_HEADER] = credential
    return client.post("/api/v1/ingest", headers=headers, content=json.dumps(
        {"agent_id": agent_id, "seq": seq, "sent_at": 1.0, "attempt": 0, "items": items}))


def _run(client: TestClient, name: str = "A") -> Any:
    r = client.get(f"/api/v1/runs/{name}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def two_runs(client: TestClient) -> tuple[int, int, str]:
    """Run A's agent (its first batch stored: steps 0-4) and a holder registered on run B
    only; returns (A's agent id, its next seq, B's credential)."""
    a = register(client, run="A", node="n0")
    ingest(client, a["agent_id"], 0, [step(0, s, world_size=1) for s in range(5)])
    b = register(client, run="B", node="n0")
    return int(a["agent_id"]), 1, str(b.get("credential"))


HOSTILE_ITEMS = {
    "pre-claimed seq": [step(0, 5, world_size=1)],
    "fake crash": [crash()],
    "NaN loss": [step(0, 5, world_size=1, loss=float("nan"))],
    "completed": [{"type": "exit", "attempt": 0, "t": 1.0, "exit_code": 0, "signal": None,
                   "outcome": "completed"}],
}


@pytest.mark.parametrize("what", list(HOSTILE_ITEMS))
@pytest.mark.parametrize("credential", ["B's", "none", "made up"])
def test_another_agents_batch_is_403_and_stores_nothing(
        client: TestClient, db: Database, evaluator: Evaluator,
        two_runs: tuple[int, int, str], what: str, credential: str) -> None:
    a_id, seq, b_cred = two_runs
    cred = {"B's": b_cred, "none": None, "made up": "twa_" + "x" * 43}[credential]
    with db.read() as c:
        before = {t: count_rows(c, t) for t in ("rank_steps", "exits", "ingested_batches")}
    r = _post(client, a_id, seq, HOSTILE_ITEMS[what], cred)
    assert r.status_code == 403, r.text
    assert r.headers["x-trainwarden-credential"] == "invalid"
    evaluator.tick()
    with db.read() as c:
        assert {t: count_rows(c, t) for t in before} == before
    assert _run(client)["status"] == "running"
    assert _run(client)["attempt"] == 0


def test_a_pre_claim_cannot_make_the_real_batch_a_duplicate(
        client: TestClient, two_runs: tuple[int, int, str]) -> None:
    a_id, seq, b_cred = two_runs
    assert _post(client, a_id, seq, [step(0, 5, world_size=1)], b_cred).status_code == 403
    real = ingest(client, a_id, seq, [step(0, 5, world_size=1, loss=0.5)])
    assert real["duplicate"] is False
    assert _run(client)["step"] == 5


def test_another_agents_commands_cannot_be_acknowledged(
        client: TestClient, evaluator: Evaluator, two_runs: tuple[int, int, str]) -> None:
    """The restart queued for A's agent stays pending until A itself acknowledges it."""
    a_id, seq, b_cred = two_runs
    ingest(client, a_id, seq, [crash()])
    evaluator.tick()
    reply = ingest(client, a_id, seq + 1, [])
    (cmd,) = reply["commands"]
    ack = {"type": "command_result", "t": 1.0, "command_id": cmd["id"], "status": "failed",
           "detail": "forged"}
    assert _post(client, a_id, seq + 2, [ack], b_cred).status_code == 403
    assert [c["id"] for c in ingest(client, a_id, seq + 2, [])["commands"]] == [cmd["id"]]
    assert _run(client)["status"] == "restarting"


def test_the_credential_is_shown_once_and_stored_hashed(client: TestClient, db: Database
                                                        ) -> None:
    from sqlalchemy import select

    from trainwarden.supervisor.store.tables import agent_credentials

    cred = register(client, run="A")["credential"]
    assert cred.startswith("twa_") and len(cred) >= 40
    with db.read() as c:
        (stored,) = c.execute(select(agent_credentials.c.secret_hash)).scalars()
    assert cred not in stored and stored.startswith("sha256:")
    assert cred not in json.dumps(_run(client))


# ---- re-registration and takeover ---------------------------------------------------------


def _register(client: TestClient, credential: str | None = None, *, host: str = "h1",
              headers: dict[str, str] = AGENT, takeover: bool = False) -> Any:
    h = {**headers, **({CREDENTIAL_HEADER: credential} if credential else {})}
    return client.post("/api/v1/agents/register", headers=h, json={
        "run": "A", "node": "n0", "hostname": host, "pid": 7, "takeover": takeover})


def test_a_live_node_is_not_taken_by_a_registration_without_its_credential(
        client: TestClient, clock: FakeClock) -> None:
    first = _register(client, host="h0").json()
    clock.advance(10)  # within the node-lost deadline (30 s)
    r = _register(client, host="h1")
    assert r.status_code == 409
    detail = r.json()["detail"]
    assert f"held by agent {first['agent_id']}" in detail and "'h0'" in detail
    assert "takeover" in detail
    assert int(r.headers["retry-after"]) == 21
    # the holder keeps the node and its credential
    assert _run(client)["agents"][0]["hostname"] == "h0"
    assert _post(client, first["agent_id"], 0, [], first["credential"]).status_code == 200


def test_the_agent_presenting_its_credential_re_registers_and_keeps_it(
        client: TestClient, clock: FakeClock) -> None:
    first = _register(client, host="h0").json()
    clock.advance(1)  # a quick restart of the agent
    again = _register(client, first["credential"], host="h0")
    assert again.status_code == 200
    assert again.json()["agent_id"] == first["agent_id"]
    assert again.json()["credential"] == first["credential"]
    assert _post(client, first["agent_id"], 0, [], first["credential"]).status_code == 200


def test_a_silent_holder_is_replaced_and_its_credential_revoked(
        client: TestClient, clock: FakeClock) -> None:
    first = _register(client, host="h0").json()
    clock.advance(31)  # past the node-lost deadline
    second = _register(client, host="h1")
    assert second.status_code == 200
    new = second.json()
    assert new["agent_id"] == first["agent_id"] and new["credential"] != first["credential"]
    assert _post(client, first["agent_id"], 0, [], first["credential"]).status_code == 403
    assert _post(client, new["agent_id"], 0, [], new["credential"]).status_code == 200


def test_takeover_needs_the_operator_token(client: TestClient) -> None:
    _register(client, host="h0")
    r = _register(client, host="h1", takeover=True)
    assert r.status_code == 403 and "operator" in r.json()["detail"]


def _actions(client: TestClient) -> list[dict[str, Any]]:
    r = client.get("/api/v1/runs/A/actions", headers=OPERATOR)
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["actions"]
    return out


def test_an_operator_takeover_at_registration_revokes_and_is_audited(
        client: TestClient) -> None:
    first = _register(client, host="h0").json()
    r = _register(client, host="h1", headers=OPERATOR, takeover=True)
    assert r.status_code == 200, r.text
    assert _post(client, first["agent_id"], 0, [], first["credential"]).status_code == 403
    assert _post(client, first["agent_id"], 0, [], r.json()["credential"]).status_code == 200
    (action,) = _actions(client)
    assert action["kind"] == "takeover" and action["actor"].startswith("operator")
    assert "'h0'" in action["reason"] and "'h1'" in action["reason"]


def test_the_takeover_endpoint_frees_the_node_for_the_new_agent_only(
        client: TestClient) -> None:
    first = _register(client, host="h0").json()
    r = client.post("/api/v1/runs/A/nodes/n0/takeover", headers=AGENT)
    assert r.status_code == 403
    r = client.post("/api/v1/runs/A/nodes/n0/takeover", headers=OPERATOR)
    assert r.status_code == 200, r.text
    assert _post(client, first["agent_id"], 0, [], first["credential"]).status_code == 403
    # the old agent, registering again with its revoked credential, is told it was replaced
    old = _register(client, first["credential"], host="h0")
    assert old.status_code == 409 and "taken over" in old.json()["detail"]
    new = _register(client, host="h1")
    assert new.status_code == 200
    assert _post(client, first["agent_id"], 0, [], new.json()["credential"]).status_code == 200
    assert [a["kind"] for a in _actions(client)] == ["takeover"]
    assert client.post("/api/v1/runs/A/nodes/nope/takeover",
                       headers=OPERATOR).status_code == 404

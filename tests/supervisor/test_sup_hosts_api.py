"""The hosts routes on SQLite and Postgres: the operator's cordon and uncordon (audited with
who and why), probation ended by a passed preflight, the hosts list and one node's ledger;
refused without the operator token, with a run-scoped token and with bad input (nothing
changed)."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    ADMIN,
    ADMIN_TOKEN,
    AGENT,
    OPERATOR,
    FakeClock,
    ingest,
    make_settings,
    register,
    store_snapshot,
)
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database


@pytest.fixture
def app(db: Database, clock: FakeClock) -> FastAPI:
    return create_app(make_settings(admin_token=ADMIN_TOKEN), db=db, clock=clock,
                      upgrade_schema=False, start_evaluator=False)


def post(client: TestClient, node: str, what: str, body: Any,
         headers: dict[str, str] = OPERATOR) -> Any:
    return client.post(f"/api/v1/hosts/{node}/{what}", headers=headers, json=body)


def test_an_operator_cordons_and_uncordons_and_a_passed_preflight_ends_probation(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    a = register(client, node="rack1/n0")["agent_id"]
    r = post(client, "rack1/n0", "cordon", {"reason": "fans failing"})
    assert r.status_code == 200, r.text
    assert r.json()["node"] == "rack1/n0" and r.json()["state"] == "cordoned"
    cordon_id = r.json()["action_id"]

    clock.advance(60)
    r = post(client, "rack1/n0", "uncordon", {"reason": "fans replaced"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "probation"

    one = client.get("/api/v1/hosts/rack1/n0", headers=OPERATOR).json()
    assert (one["state"], one["actor"], one["reason"]) == ("probation", "operator",
                                                          "fans replaced")
    assert [(x["kind"], x["actor"], x["reason"]) for x in one["actions"]] == [
        ("uncordon", "operator", "fans replaced"), ("cordon", "operator", "fans failing")]
    assert one["actions"][1]["id"] == cordon_id

    # a passed preflight reported by the node's agent: healthy again, audited
    clock.advance(10)
    ingest(client, a, 0, [{"type": "event", "attempt": 0, "rank": 0, "t": clock.now,
                           "name": "preflight",
                           "details": {"passed": True, "failed": None, "checks": []}}])
    evaluator.tick()
    one = client.get("/api/v1/hosts/rack1/n0", headers=OPERATOR).json()
    assert one["state"] == "healthy"
    assert (one["actions"][0]["kind"], one["actions"][0]["actor"]) == ("probation_passed",
                                                                       "policy")
    assert one["evidence"][0]["kind"] == "preflight_passed"


def test_a_node_no_agent_registered_may_be_cordoned(client: TestClient) -> None:
    assert client.get("/api/v1/hosts/spare-7", headers=OPERATOR).status_code == 404
    r = post(client, "spare-7", "cordon", {"reason": "  known bad PSU  "})
    assert r.status_code == 200, r.text
    one = client.get("/api/v1/hosts/spare-7", headers=OPERATOR).json()
    assert one["state"] == "cordoned" and one["reason"] == "known bad PSU"


def test_the_hosts_list_shows_every_known_node(client: TestClient) -> None:
    register(client, node="n0")
    register(client, node="n1")
    assert post(client, "n1", "cordon", {"reason": "ECC"}).status_code == 200
    body = client.get("/api/v1/hosts", headers=OPERATOR).json()
    assert body["window_s"] == 86400
    got = {h["node"]: (h["state"], h["reason"], h["evidence_count"]) for h in body["hosts"]}
    assert got == {"n0": ("healthy", "", 0), "n1": ("cordoned", "ECC", 0)}
    # any unscoped token reads it
    assert client.get("/api/v1/hosts", headers=AGENT).status_code == 200


def test_changes_that_make_no_sense_are_409_and_change_nothing(
        client: TestClient, db: Database) -> None:
    register(client, node="n0")
    before = store_snapshot(db)
    r = post(client, "n0", "uncordon", {"reason": "why not"})
    assert r.status_code == 409
    assert r.json()["detail"] == ("nothing done: node n0 is healthy, not cordoned: nothing to "
                                  "uncordon")
    assert store_snapshot(db) == before
    assert post(client, "n0", "cordon", {"reason": "bad"}).status_code == 200
    before = store_snapshot(db)
    r = post(client, "n0", "cordon", {"reason": "bad again"})
    assert r.status_code == 409 and "cordoned already" in r.json()["detail"]
    assert store_snapshot(db) == before


@pytest.mark.parametrize("node, body", [
    ("n0", {}),  # no reason
    ("n0", {"reason": ""}),
    ("n0", {"reason": "   "}),
    ("n0", {"reason": "x" * 1001}),
    ("n0", {"reason": "ok", "force": True}),
    ("n0", {"reason": "evil\x1b[2J"}),
    ("n0", ["reason"]),
    ("evil%1B%5B2J", {"reason": "a control character in the node's name"}),
    ("x" * 201, {"reason": "too long a name"}),
])
def test_bad_input_is_422_and_changes_nothing(client: TestClient, db: Database, node: str,
                                              body: Any) -> None:
    register(client, node="n0")
    before = store_snapshot(db)
    for what in ("cordon", "uncordon"):
        r = post(client, node, what, body)
        assert r.status_code == 422, (what, r.text)
        assert r.json()["detail"].startswith("invalid request: ")
    assert store_snapshot(db) == before


def test_refused_without_the_operator_token_or_with_a_scoped_one(
        client: TestClient, db: Database) -> None:
    register(client, node="n0")
    r = client.post("/api/v1/tokens", headers=ADMIN,
                    json={"name": "team-a", "role": "operator", "scope": "team-a-*"})
    scoped = {"Authorization": f"Bearer {r.json()['token']}"}
    before = store_snapshot(db)
    for what in ("cordon", "uncordon"):
        assert post(client, "n0", what, {"reason": "x"}, headers={}).status_code == 401
        assert post(client, "n0", what, {"reason": "x"}, headers=AGENT).status_code == 403
        r = post(client, "n0", what, {"reason": "x"}, headers=scoped)
        assert r.status_code == 403 and "scoped" in r.json()["detail"]
    assert client.get("/api/v1/hosts", headers=scoped).status_code == 403
    assert client.get("/api/v1/hosts/n0", headers=scoped).status_code == 403
    assert client.get("/api/v1/hosts").status_code == 401
    after = store_snapshot(db)
    after.pop("api_tokens"), before.pop("api_tokens")  # (last_used_at of the scoped token)
    assert after == before
    # the admin token acts as an operator, and its actions say so
    assert post(client, "n0", "cordon", {"reason": "x"}, headers=ADMIN).json()["state"] == \
        "cordoned"
    (act,) = client.get("/api/v1/hosts/n0", headers=OPERATOR).json()["actions"]
    assert act["actor"] == "admin"

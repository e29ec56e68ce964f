"""Tokens with roles: viewer, agent, operator, admin, optionally scoped to
runs; the settings' tokens as bootstrap tokens; the token routes and CLI; and a token x route
x role matrix over every route the app has (API, dashboard, /metrics)."""

from __future__ import annotations

from collections.abc import Iterator
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
    make_settings,
    register,
    step,
)
from tests.supervisor.sup_helpers import ingest as ingest_batch
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database


@pytest.fixture
def app(db: Database, clock: FakeClock) -> FastAPI:
    return create_app(make_settings(admin_token=ADMIN_TOKEN), db=db, clock=clock,
                      upgrade_schema=False, start_evaluator=False)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    with TestClient(app) as c:
        yield c


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _create(client: TestClient, name: str, role: str, scope: str | None = None) -> str:
    r = client.post("/api/v1/tokens", headers=ADMIN,
                    json={"name": name, "role": role, "scope": scope})
    assert r.status_code == 201, r.text
    token: str = r.json()["token"]
    return token


# The need of every route: who may use it.  A route missing here fails the matrix test: a
# new route must say who may use it.
PUBLIC, READ, AGENT_NEED, OPERATOR_NEED, ADMIN_NEED = "public", "read", "agent", "operator", \
    "admin"
ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/api/v1/agents/register"): AGENT_NEED,
    ("POST", "/api/v1/ingest"): AGENT_NEED,
    ("POST", "/api/v1/runs/{run}/nodes/{node}/takeover"): OPERATOR_NEED,
    ("GET", "/api/v1/runs"): READ,
    ("GET", "/api/v1/runs/{run}"): READ,
    ("GET", "/api/v1/runs/{run}/steps"): READ,
    ("GET", "/api/v1/runs/{run}/ranks"): READ,
    ("GET", "/api/v1/runs/{run}/rank-rollups"): READ,
    ("GET", "/api/v1/runs/{run}/checkpoints"): READ,
    ("GET", "/api/v1/runs/{run}/incidents"): READ,
    ("GET", "/api/v1/runs/{run}/actions"): READ,
    ("GET", "/api/v1/runs/{run}/events"): READ,
    ("GET", "/api/v1/runs/{run}/goodput"): READ,
    ("POST", "/api/v1/runs/{run}/restart"): OPERATOR_NEED,
    ("POST", "/api/v1/runs/{run}/stop"): OPERATOR_NEED,
    ("POST", "/api/v1/runs/{run}/rollback"): OPERATOR_NEED,
    ("GET", "/api/v1/actions/{action_id}"): READ,
    ("POST", "/api/v1/tokens"): ADMIN_NEED,
    ("GET", "/api/v1/tokens"): ADMIN_NEED,
    ("DELETE", "/api/v1/tokens/{name}"): ADMIN_NEED,
    ("GET", "/healthz"): PUBLIC,
    ("GET", "/api/v1/healthz"): PUBLIC,
    ("GET", "/api/v1/evaluator"): READ,
    ("GET", "/api/v1/hosts"): READ,
    ("GET", "/api/v1/hosts/{node}"): READ,
    ("POST", "/api/v1/hosts/{node}/cordon"): OPERATOR_NEED,
    ("POST", "/api/v1/hosts/{node}/uncordon"): OPERATOR_NEED,
    ("GET", "/openapi.json"): PUBLIC,
    ("GET", "/docs"): PUBLIC,
    ("GET", "/login"): PUBLIC,
    ("POST", "/login"): PUBLIC,
    ("POST", "/logout"): PUBLIC,
    ("GET", "/"): READ,
    ("GET", "/runs/{run}"): READ,
    ("GET", "/hosts"): READ,
    ("GET", "/runs/{run}/tables"): READ,
    ("GET", "/dashboard/api/runs/{run}/state"): READ,
    ("GET", "/dashboard/api/runs/{run}/series"): READ,
    ("GET", "/metrics"): READ,
}
ADMITTED = {READ: {"viewer", "agent", "operator", "admin"},
            AGENT_NEED: {"agent", "operator", "admin"},
            OPERATOR_NEED: {"operator", "admin"}, ADMIN_NEED: {"admin"}}
BODIES: dict[str, Any] = {
    "/api/v1/agents/register": {"run": "r9", "node": "n9"},
    "/api/v1/ingest": {"agent_id": 999, "seq": 0, "items": []},
    "/api/v1/runs/{run}/restart": {"reason": "matrix"},
    "/api/v1/runs/{run}/stop": {"reason": "matrix"},
    "/api/v1/runs/{run}/rollback": {"step": 99999},
    "/api/v1/tokens": {"name": "made-by-matrix", "role": "viewer"},
    "/api/v1/hosts/{node}/cordon": {"reason": "matrix"},
    "/api/v1/hosts/{node}/uncordon": {"reason": "matrix"},
}


def test_every_route_of_the_openapi_document_is_in_the_matrix(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert documented - set(ROUTES) == set()


def test_token_route_role_matrix(client: TestClient, app: FastAPI) -> None:
    """Every route, with no token and with each role's token (stored and, where one
    exists, from the settings): admitted (any answer but 401/403) exactly where the role may
    use the route."""
    register(client, run="zz", node="n0")  # a run to point at (restart/stop are on "zz"
    tokens = {
        "none": {},
        "viewer": _bearer(_create(client, "v", "viewer")),
        "agent": _bearer(_create(client, "a", "agent")),
        "operator": _bearer(_create(client, "o", "operator")),
        "admin": _bearer(_create(client, "ad", "admin")),
        "settings agent": AGENT,
        "settings operator": OPERATOR,
        "settings admin": ADMIN,
    }
    wrong: list[str] = []
    for (method, path), need in sorted(ROUTES.items()):
        url = (path.replace("{run}", "zz").replace("{node}", "n0")
               .replace("{action_id}", "1").replace("{name}", "nobody"))
        for who, headers in tokens.items():
            role = who.split()[-1]
            kw: dict[str, Any] = {"headers": {**headers, "origin": "http://testserver"}}
            if path in BODIES:
                kw["json"] = BODIES[path]
            if (method, path) == ("POST", "/api/v1/tokens"):
                kw["json"] = {"name": f"m-{who.replace(' ', '-')}", "role": "viewer"}
            if (method, path) in (("POST", "/login"), ("POST", "/logout")):
                kw["data"] = {"token": ""}
                kw.pop("json", None)
            r = client.request(method, url, follow_redirects=False, **kw)
            admitted = r.status_code not in (401, 403)
            expect = need == PUBLIC or role in ADMITTED.get(need, set())
            if (method, path) == ("POST", "/login"):
                expect = False  # an empty token is refused whoever asks
            if admitted != expect:
                wrong.append(f"{method} {path} as {who}: {r.status_code}")
    assert wrong == []


def test_stored_tokens_are_listed_without_secrets_and_revoked(client: TestClient,
                                                              clock: FakeClock) -> None:
    secret = _create(client, "ci", "viewer")
    assert client.get("/api/v1/runs", headers=_bearer(secret)).status_code == 200
    clock.advance(5)
    listed = client.get("/api/v1/tokens", headers=ADMIN).json()["tokens"]
    (row,) = listed
    assert row["name"] == "ci" and row["role"] == "viewer"
    assert row["last_used_at"] == pytest.approx(clock.now - 5)
    assert secret not in str(listed) and "secret_hash" not in row
    assert client.delete("/api/v1/tokens/ci", headers=ADMIN).status_code == 200
    assert client.get("/api/v1/runs", headers=_bearer(secret)).status_code == 401
    assert client.delete("/api/v1/tokens/ci", headers=ADMIN).status_code == 404


def test_token_names_are_unique_and_every_role_but_admin_may_be_scoped(
        client: TestClient) -> None:
    _create(client, "ci", "viewer")
    r = client.post("/api/v1/tokens", headers=ADMIN, json={"name": "ci", "role": "agent"})
    assert r.status_code == 409 and "exists" in r.json()["detail"]
    for role in ("viewer", "agent", "operator"):
        r = client.post("/api/v1/tokens", headers=ADMIN,
                        json={"name": f"s-{role}", "role": role, "scope": "a*"})
        assert r.status_code == 201 and r.json()["scope"] == "a*", r.text
    r = client.post("/api/v1/tokens", headers=ADMIN,
                    json={"name": "ad2", "role": "admin", "scope": "a"})
    assert r.status_code == 422 and "no scope" in r.json()["detail"]
    r = client.post("/api/v1/tokens", headers=OPERATOR, json={"name": "x", "role": "admin"})
    assert r.status_code == 403


def test_a_scoped_agent_token_registers_only_in_its_runs(client: TestClient) -> None:
    tok = _bearer(_create(client, "team-a", "agent", scope="team-a-*"))
    assert register(client, run="team-a-1", headers=tok)["agent_id"]
    r = client.post("/api/v1/agents/register", headers=tok, json={"run": "team-b", "node": "n"})
    assert r.status_code == 403 and "outside" in r.json()["detail"]


def test_a_scoped_operator_acts_only_on_its_run_and_its_actions_name_it(
        client: TestClient) -> None:
    for run in ("mine", "theirs"):
        a = register(client, run=run)["agent_id"]
        ingest_batch(client, a, 0, [step(0, 0, world_size=1)])
    tok = _bearer(_create(client, "alice", "operator", scope="mine"))
    assert client.post("/api/v1/runs/theirs/stop", headers=tok,
                       json={"reason": "x"}).status_code == 403
    assert client.post("/api/v1/runs/mine/restart", headers=tok,
                       json={"reason": "x"}).status_code == 200
    (action,) = client.get("/api/v1/runs/mine/actions", headers=OPERATOR).json()["actions"]
    assert action["actor"] == "operator:alice"
    r = client.post("/api/v1/runs/theirs/restart", headers=OPERATOR, json={"reason": "x"})
    assert r.status_code == 200
    (action,) = client.get("/api/v1/runs/theirs/actions", headers=OPERATOR).json()["actions"]
    assert action["actor"] == "operator"  # the settings' bootstrap operator token


def test_the_token_cli_goes_through_the_api(app: FastAPI, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    from tests.dashboard.browser import serve_in_thread
    from trainwarden.supervisor.cli import main as cli

    monkeypatch.setenv("TRAINWARDEN_ADMIN_TOKEN", ADMIN_TOKEN)
    with serve_in_thread(app) as base:
        at = ["--supervisor", base]
        assert cli.main(["token", "create", "ci", "--role", "operator", "--scope", "exp-*",
                         *at]) == 0
        secret = capsys.readouterr().out.strip().splitlines()[-1]
        assert secret.startswith("twt_")
        assert cli.main(["token", "list", *at]) == 0
        out = capsys.readouterr().out
        assert "ci" in out and "operator" in out and "exp-*" in out and secret not in out
        assert cli.main(["token", "revoke", "ci", *at]) == 0
        assert cli.main(["token", "revoke", "ci", *at]) == 1
        assert "no token named 'ci'" in capsys.readouterr().err
        assert cli.main(["token", "list", "--token", "wrong", *at]) == 1


def test_an_out_of_scope_token_of_every_role_is_refused_on_every_route_of_another_run(
        client: TestClient) -> None:
    """Every route of the matrix that names a run (or shows every run: /metrics), walked with
    a token of each role scoped to another run: 403 or 404, never the other run's data.  The
    runs list and the dashboard's list hold only the token's own runs."""
    theirs = register(client, run="theirs", node="n0")["agent_id"]
    ingest_batch(client, theirs, 0, [step(0, 0, world_size=1)])
    assert client.post("/api/v1/runs/theirs/restart", headers=OPERATOR,
                       json={"reason": "an action of theirs"}).status_code == 200
    (action,) = client.get("/api/v1/runs/theirs/actions", headers=OPERATOR).json()["actions"]
    register(client, run="mine-1", node="n0")
    scoped = {role: _bearer(_create(client, f"scoped-{role}", role, scope="mine-*"))
              for role in ("viewer", "agent", "operator")}
    wrong: list[str] = []
    for (method, path), need in sorted(ROUTES.items()):
        if "{run}" not in path and path not in ("/api/v1/actions/{action_id}", "/metrics"):
            continue
        url = (path.replace("{run}", "theirs").replace("{node}", "n0")
               .replace("{action_id}", str(action["id"])))
        for role, headers in scoped.items():
            if role not in ADMITTED.get(need, set()):
                continue  # refused for its role already (the matrix above)
            kw: dict[str, Any] = {"headers": {**headers, "origin": "http://testserver"}}
            if path in BODIES:
                kw["json"] = BODIES[path]
            r = client.request(method, url, follow_redirects=False, **kw)
            if r.status_code not in (403, 404) or "theirs" in r.text.replace(
                    "'theirs'", "").replace("run theirs", ""):
                wrong.append(f"{method} {path} as scoped {role}: {r.status_code}")
    assert wrong == []
    for role, headers in scoped.items():
        names = [r["name"] for r in client.get("/api/v1/runs", headers=headers).json()["runs"]]
        assert names == ["mine-1"], role
        page = client.get("/", headers=headers).text
        assert "mine-1" in page and "theirs" not in page, role
        assert client.get("/api/v1/runs/mine-1", headers=headers).status_code == 200


def test_with_public_reads_a_scoped_token_reads_every_run_and_acts_on_its_own(
        db: Database, clock: FakeClock) -> None:
    app = create_app(make_settings(admin_token=ADMIN_TOKEN, public_reads=True), db=db,
                     clock=clock, upgrade_schema=False, start_evaluator=False)
    with TestClient(app) as client:
        register(client, run="theirs", node="n0")
        tok = _bearer(_create(client, "alice", "operator", scope="mine"))
        assert client.get("/api/v1/runs/theirs", headers=tok).status_code == 200
        assert client.get("/metrics", headers=tok).status_code == 200
        assert client.post("/api/v1/runs/theirs/stop", headers=tok,
                           json={"reason": "x"}).status_code == 403

"""Every JSON route declares its answer (``trainwarden.supervisor.api.responses``), and every
answer is
what it declares.

* the OpenAPI document gives every JSON operation a 2xx schema that is a model (a
  ``response_model=None`` route without ``responses=`` fails here), and so does each JSON
  route kept out of the document (the dashboard's feeds);
* on a store seeded with every kind of record (restarts with their anatomy, a rollback, a
  stop, a takeover, a NaN loss, rolled-up per-rank rows, tokens, a run with nothing yet),
  each route's real answer validates against the schema ``/openapi.json`` declares for it,
  strictly: a key the schema does not declare fails, so the models list every key;
* the answers are still rendered as the routes return them (no response model filters or
  re-serializes them: a NaN loss still reads "NaN")."""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fastapi.routing
import jsonschema
import pytest
from fastapi import FastAPI
from fastapi.datastructures import DefaultPlaceholder
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel

from tests.dashboard.apps import FakeClock, build_app, sqlite_db
from tests.dashboard.synth import OPERATOR, SynthRun, efficiency_script
from trainwarden.supervisor.api import responses
from trainwarden.supervisor.control.retention import Retention, RetentionConfig

ADMIN_TOKEN = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# Routes whose answer is no JSON although their response class is the JSON default: the
# sign-in form's posts answer a redirect or the login page.
NOT_JSON = {("POST", "/login"), ("POST", "/logout")}


@dataclass
class Exchange:
    method: str
    template: str  # the route's path
    status: int
    body: Any
    text: str


# ---------------------------------------------------------------------------------------------
# which routes answer JSON, and what they declare


def _response_class(route: Any) -> Any:
    rc = route.response_class
    return rc.value if isinstance(rc, DefaultPlaceholder) else rc


def _api_routes(app: FastAPI) -> Iterator[Any]:
    """Every API route as the app serves it (an included router's routes with its prefix,
    responses and response class: FastAPI keeps them apart from ``app.routes``)."""
    contexts = getattr(fastapi.routing, "iter_route_contexts", None)
    for route in contexts(app.routes) if contexts is not None else app.routes:
        if isinstance(getattr(route, "original_route", route), APIRoute):
            yield route


def _json_routes(app: FastAPI) -> list[tuple[str, Any]]:
    """(method, route) of every route that answers JSON."""
    out = []
    for route in _api_routes(app):
        rc = _response_class(route)
        if issubclass(rc, HTMLResponse) or not issubclass(rc, JSONResponse):
            continue  # pages, /metrics' text
        for method in sorted(route.methods):
            if (method, route.path_format) not in NOT_JSON:
                out.append((method, route))
    return out


def _declared_model(route: Any, status: int) -> type[BaseModel] | None:
    declared = route.responses.get(status, {}).get("model")
    if isinstance(declared, type) and issubclass(declared, BaseModel):
        return declared
    rm = route.response_model
    if status == (route.status_code or 200) and isinstance(rm, type) \
            and issubclass(rm, BaseModel):
        return rm
    return None


def undeclared(app: FastAPI) -> list[str]:
    """The JSON operations without a 2xx model: in the OpenAPI document (its schema), and
    among the routes it leaves out (their ``responses=``)."""
    doc = app.openapi()
    missing = []
    for method, route in _json_routes(app):
        ok = route.status_code or 200
        if route.include_in_schema:
            op = doc["paths"][route.path_format][method.lower()]
            schemas = [c.get("schema") or {}
                       for code, r in op["responses"].items() if code.startswith("2")
                       for c in (r.get("content") or {}).values()]
            # a model: a reference to a component (an empty or a free-form object says nothing)
            if not any("$ref" in s for s in schemas):
                missing.append(f"{method} {route.path_format}")
        elif _declared_model(route, ok) is None:
            missing.append(f"{method} {route.path_format} (not in the document)")
    return missing


def _strict(schema: Any) -> Any:
    """The schema with every object that lists its properties closed to other keys."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _validator(app: FastAPI, method: str, template: str, status: int
               ) -> jsonschema.protocols.Validator:
    doc = app.openapi()
    op = doc.get("paths", {}).get(template, {}).get(method.lower())
    if op is not None:
        schema = op["responses"][str(status)]["content"]["application/json"]["schema"]
        root = {**schema, "components": doc["components"]}  # its $refs resolve in the doc
    else:  # a route the document leaves out: its declared model's own schema
        route = next(r for r in _api_routes(app)
                     if r.path_format == template and method in r.methods)
        model = _declared_model(route, status)
        assert model is not None, f"{method} {template} declares no {status} answer"
        root = model.model_json_schema(mode="serialization")
    return jsonschema.Draft202012Validator(_strict(root))


# ---------------------------------------------------------------------------------------------
# a store with every kind of record


@pytest.fixture(scope="module")
def seeded() -> Iterator[tuple[FastAPI, list[Exchange]]]:
    with tempfile.TemporaryDirectory(prefix="tw-resp-") as d:
        db = sqlite_db(Path(d) / "tw.db")
        clock = FakeClock()
        app = build_app(db, clock, admin_token=ADMIN_TOKEN)
        try:
            with TestClient(app) as c:
                yield app, _exchanges(c, clock, app)
        finally:
            db.dispose()


def _exchanges(c: TestClient, clock: FakeClock, app: FastAPI) -> list[Exchange]:
    ev = app.state.evaluator
    out: list[Exchange] = []

    def call(method: str, template: str, path: str | None = None,
             headers: dict[str, str] = OPERATOR, **kw: Any) -> Any:
        r = c.request(method, path or template, headers=headers, **kw)
        assert r.status_code < 300, (method, path or template, r.status_code, r.text)
        out.append(Exchange(method, template, r.status_code, r.json(), r.text))
        return r.json()

    # alpha: a crash, a restart with every milestone, FLOPs declared, goodput accounted
    efficiency_script(c, clock, ev)
    # beta: checkpoints; rolled back, restarted and one node taken over by the operator
    beta = SynthRun(c, "beta").register()
    beta.train(range(0, 40), t0=clock.now, checkpoint_every=10, clock=clock)
    # gamma: a NaN loss at its newest step (each rank's latest report is NaN)
    gamma = SynthRun(c, "gamma").register()
    gamma.train(range(0, 20), t0=clock.now, nan_at=19, clock=clock)
    # delta: long enough for retention to roll up per-rank rows (a NaN among them)
    delta = SynthRun(c, "delta", nodes=1).register()
    delta.train(range(0, 450), t0=clock.now, dt=0.1, nan_at=50, clock=clock)
    # beta's node n0 fails a preflight: the ledger records it and cordons n0 at the tick
    beta.send(0, [{"type": "event", "attempt": 0, "rank": 0, "t": clock.now,
                   "name": "preflight", "details": {"passed": False, "failed": "gpu_burn",
                                                    "checks": [{"name": "gpu_burn"}]}}])
    retention = Retention(RetentionConfig(keep_steps=300, bucket_steps=100))
    while retention.tick(app.state.db):
        pass
    clock.advance(5.0)
    ev.tick()
    # empty: registered, nothing reported, not accounted by the evaluator yet
    SynthRun(c, "empty", nodes=1).register()

    run = "/api/v1/runs/{run}"
    call("POST", run + "/rollback", "/api/v1/runs/beta/rollback",
         json={"step": 20, "skip": [[1, 5]], "lr_scale": 0.5, "lr_scale_steps": 10})
    call("POST", run + "/restart", "/api/v1/runs/beta/restart", json={"reason": "operator"})
    call("POST", run + "/nodes/{node}/takeover", "/api/v1/runs/beta/nodes/n1/takeover")
    call("POST", run + "/stop", "/api/v1/runs/delta/stop", json={"reason": "done"})
    call("POST", "/api/v1/tokens", headers=ADMIN,
         json={"name": "ops", "role": "operator", "scope": "al*"})
    call("POST", "/api/v1/tokens", headers=ADMIN, json={"name": "view", "role": "viewer"})
    call("GET", "/api/v1/tokens", headers=ADMIN)
    call("DELETE", "/api/v1/tokens/{name}", "/api/v1/tokens/view", headers=ADMIN)
    call("GET", "/api/v1/runs")
    for name in ("alpha", "beta", "gamma", "delta", "empty"):
        call("GET", run, f"/api/v1/runs/{name}")
        for tail in ("/goodput", "/steps", "/ranks", "/rank-rollups", "/checkpoints",
                     "/incidents", "/actions", "/events"):
            call("GET", run + tail, f"/api/v1/runs/{name}{tail}")
        call("GET", "/dashboard/api/runs/{run}/state", f"/dashboard/api/runs/{name}/state")
        call("GET", "/dashboard/api/runs/{run}/series", f"/dashboard/api/runs/{name}/series")
    call("GET", run + "/goodput", "/api/v1/runs/alpha/goodput", params={"window_s": 30})
    call("GET", run + "/steps", "/api/v1/runs/alpha/steps", params={"max_points": 7})
    call("GET", run + "/steps", "/api/v1/runs/delta/steps", params={"max_points": 9})
    call("GET", run + "/rank-rollups", "/api/v1/runs/delta/rank-rollups", params={"rank": 1})
    for action in c.get("/api/v1/runs/beta/actions", headers=OPERATOR).json()["actions"] + \
            c.get("/api/v1/runs/alpha/actions", headers=OPERATOR).json()["actions"]:
        call("GET", "/api/v1/actions/{action_id}", f"/api/v1/actions/{action['id']}")
    host = "/api/v1/hosts/{node}"
    call("GET", "/api/v1/hosts")
    call("GET", host, "/api/v1/hosts/n0")
    call("POST", host + "/uncordon", "/api/v1/hosts/n0/uncordon", json={"reason": "fixed"})
    call("POST", host + "/cordon", "/api/v1/hosts/n1/cordon", json={"reason": "fans"})
    call("GET", host, "/api/v1/hosts/n1")
    call("GET", "/api/v1/hosts")
    call("GET", "/api/v1/evaluator")
    call("GET", "/healthz")
    call("GET", "/api/v1/healthz")
    return out


# ---------------------------------------------------------------------------------------------
# the tests


def test_every_json_route_declares_its_answer(seeded: tuple[FastAPI, list[Exchange]]) -> None:
    app, _ = seeded
    assert _json_routes(app), "no JSON route found: the walk is broken"
    assert undeclared(app) == []


def test_a_route_without_a_response_model_is_caught(tmp_path: Path) -> None:
    db = sqlite_db(tmp_path / "tw.db")
    try:
        app = build_app(db, FakeClock())
        assert undeclared(app) == []

        def probe() -> dict[str, Any]:
            return {"x": 1}

        app.add_api_route("/api/v1/probe", probe, response_model=None)
        app.add_api_route("/dashboard/api/probe", probe, response_model=None,
                          include_in_schema=False)
        app.openapi_schema = None
        assert undeclared(app) == ["GET /api/v1/probe",
                                   "GET /dashboard/api/probe (not in the document)"]
    finally:
        db.dispose()


def test_every_json_route_is_exercised(seeded: tuple[FastAPI, list[Exchange]]) -> None:
    """A new route needs an exchange in ``_exchanges`` (its answer checked below)."""
    app, exchanges = seeded
    called = {(e.method, e.template) for e in exchanges}
    routes = {(m, r.path_format) for m, r in _json_routes(app)}
    routes.discard(("POST", "/api/v1/agents/register"))  # every seeded run registers
    routes.discard(("POST", "/api/v1/ingest"))  # and ingests (their models validate them)
    assert routes - called == set()


def test_every_answer_matches_its_declared_schema(
        seeded: tuple[FastAPI, list[Exchange]]) -> None:
    app, exchanges = seeded
    problems = []
    for e in exchanges:
        v = _validator(app, e.method, e.template, e.status)
        for err in v.iter_errors(e.body):
            where = "/".join(str(p) for p in err.absolute_path)
            problems.append(f"{e.method} {e.template} ({e.status}) at {where or '.'}: "
                            f"{err.message[:200]}")
    assert not problems, f"{len(problems)} answers off their schema:\n" + "\n".join(problems[:40])


def test_the_seeded_answers_cover_the_nullable_and_odd_cases(
        seeded: tuple[FastAPI, list[Exchange]]) -> None:
    """The store holds what the schemas allow for: a NaN loss, rolled-up rows, a run with
    nothing yet, restarts with and without an anatomy."""
    _, exchanges = seeded
    by: dict[tuple[str, str], list[Exchange]] = {}
    for e in exchanges:
        by.setdefault((e.method, e.template), []).append(e)
    ranks = [e for e in by[("GET", "/api/v1/runs/{run}/ranks")] if '"loss":"NaN"' in e.text]
    assert ranks, "no rank reports a NaN loss"
    assert any(e.body["rollups"] and e.body["rolled_up_steps"]
               for e in by[("GET", "/api/v1/runs/{run}/rank-rollups")])
    runs = by[("GET", "/api/v1/runs/{run}")]
    assert any(e.body["step"] is None and e.body["mfu"] is None and e.body["goodput"] is None
               for e in runs)
    assert any(e.body["last_restart"] and e.body["last_restart"]["anatomy"] for e in runs)
    actions = [a for e in by[("GET", "/api/v1/runs/{run}/actions")] for a in e.body["actions"]]
    assert {a["kind"] for a in actions} >= {"restart", "stop", "takeover"}
    assert any(a["plan"] and a["plan"].get("lr") for a in actions)  # the rollback's plan
    assert any(e.body["current"] is None for e in by[("GET", "/api/v1/runs/{run}/goodput")])
    listed = [h for e in by[("GET", "/api/v1/hosts")] for h in e.body["hosts"]]
    assert {h["state"] for h in listed} == {"healthy", "cordoned", "probation"}
    assert any(h["latest_evidence"] is None for h in listed)
    assert any(h["latest_evidence"] is not None for h in listed)


def test_answers_are_rendered_as_the_routes_return_them(
        seeded: tuple[FastAPI, list[Exchange]]) -> None:
    """The answer models only document: no route validates or re-serializes its answer
    through one (a NaN would read null, a whole float 1 instead of 1.0, keys dropped)."""
    app, _ = seeded
    models = {m for m in vars(responses).values()
              if isinstance(m, type) and issubclass(m, BaseModel)}
    filtered = [f"{m} {r.path_format}" for m, r in _json_routes(app) if r.response_model in models]
    assert filtered == []


def test_strict_validation_refuses_an_undeclared_key(
        seeded: tuple[FastAPI, list[Exchange]]) -> None:
    app, exchanges = seeded
    e = next(x for x in exchanges if x.template == "/api/v1/runs/{run}/checkpoints"
             and x.body["checkpoints"])
    body = copy.deepcopy(e.body)
    body["checkpoints"][0]["surprise"] = 1
    assert not _validator(app, e.method, e.template, e.status).is_valid(body)

"""Hostile values on every write route and in the query and path parameters, on SQLite and
Postgres: each one is a 422 that names the field, the body has the declared error shape, and
nothing is stored."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import text

from tests.supervisor.sup_helpers import (
    AGENT,
    OPERATOR,
    FakeClock,
    as_agent,
    ingest,
    make_settings,
    register,
    step,
    store_snapshot,
)
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import Database, make_database
from trainwarden.supervisor.store.models import metadata

BIG = 2**63  # one past what a 64-bit column holds
BIG32 = 2**31  # one past what a Postgres INTEGER column holds
NAN = float("nan")
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
INF = float("inf")


def _register_body(**kw: Any) -> dict[str, Any]:
    return {"run": "r1", "node": "n0", **kw}


def _batch(aid: int, *items: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return {"agent_id": aid, "seq": 1, "sent_at": 1.0, "attempt": 0, "items": list(items), **kw}


def _ev(**kw: Any) -> dict[str, Any]:
    return {"type": "event", "name": "x", "t": 1.0, **kw}


def _ck(**kw: Any) -> dict[str, Any]:
    return {"type": "checkpoint", "step": 1, "path": "/ck/1", "t": 1.0, **kw}


def _hb(**kw: Any) -> dict[str, Any]:
    return {"type": "heartbeat", "t": 1.0, **kw}


def _exit(**kw: Any) -> dict[str, Any]:
    return {"type": "exit", "t": 1.0, "outcome": "crashed", **kw}


def _res(**kw: Any) -> dict[str, Any]:
    return {"type": "command_result", "t": 1.0, "command_id": 1, "status": "done", **kw}


# (case id, field the 422 must name, route, body builder taking the agent id).  Free text an
# agent sends (messages, details, results) is not refused but kept escaped and cut:
# test_sup_trust.py.
REGISTER = [
    ("pid-2^63", "pid", _register_body(pid=BIG)),
    ("pid-2^31", "pid", _register_body(pid=BIG32)),
    ("nproc-2^31", "nproc_per_node", _register_body(nproc_per_node=BIG32)),
    ("node-nul", "node", _register_body(node="n\x00")),
    ("hostname-nul", "hostname", _register_body(hostname="h\x00")),
    ("hostname-esc", "hostname", _register_body(hostname="h\x1b[2J")),
    ("root-nul", "checkpoint_root", _register_body(checkpoint_root="/ck\x00")),
    ("root-long", "checkpoint_root", _register_body(checkpoint_root="/" + "c" * 5000)),
    ("command-nul", "command", _register_body(command=["torchrun", "a\x00"])),
    ("version-nul", "agent_version", _register_body(agent_version="1\x00")),
]

# (A time that is not finite is not refused: it is stored as the receive time and counted,
# tests/supervisor/test_sup_clock.py.)
INGEST = [
    ("agent_id-2^63", "agent_id", lambda a: _batch(BIG)),
    ("agent_id-2^31", "agent_id", lambda a: _batch(BIG32)),
    ("seq-2^63", "seq", lambda a: _batch(a, seq=BIG)),
    ("attempt-2^31", "attempt", lambda a: _batch(a, attempt=BIG32)),
    ("dropped-2^31", "dropped", lambda a: _batch(a, dropped=BIG32)),
    ("step-2^31", "step", lambda a: _batch(a, step(0, BIG32))),
    ("step-2^63", "step", lambda a: _batch(a, step(0, BIG))),
    ("rank-2^31", "rank", lambda a: _batch(a, step(BIG32, 1))),
    ("local_rank-2^31", "local_rank", lambda a: _batch(a, step(0, 1, local_rank=BIG32))),
    ("step-pid-2^31", "pid", lambda a: _batch(a, step(0, 1, pid=BIG32))),
    ("step-attempt-2^31", "attempt", lambda a: _batch(a, step(0, 1, attempt=BIG32))),
    ("batch_index-2^63", "batch_index", lambda a: _batch(a, step(0, 1, batch_index=BIG))),
    ("samples-2^63", "samples", lambda a: _batch(a, step(0, 1, samples=BIG))),
    ("tokens-2^63", "tokens", lambda a: _batch(a, step(0, 1, tokens=BIG))),
    ("world_size-2^63", "world_size", lambda a: _batch(a, step(0, 1, world_size=BIG))),
    ("v-2^63", "v", lambda a: _batch(a, step(0, 1, v=BIG))),
    ("step_s-nan", "step_s", lambda a: _batch(a, step(0, 1, step_s=NAN))),
    ("data_s-inf", "data_s", lambda a: _batch(a, step(0, 1, data_s=INF))),
    ("event-name-nul", "name", lambda a: _batch(a, _ev(name="x\x00"))),
    ("event-step-2^31", "step", lambda a: _batch(a, _ev(step=BIG32))),
    ("event-rank-2^63", "rank", lambda a: _batch(a, _ev(rank=BIG))),
    ("ckpt-path-nul", "path", lambda a: _batch(a, _ck(path="/ck/\x00"))),
    ("ckpt-path-long", "path", lambda a: _batch(a, _ck(path="/" + "c" * 5000))),
    ("ckpt-step-2^31", "step", lambda a: _batch(a, _ck(step=BIG32))),
    ("ckpt-bytes-2^63", "bytes", lambda a: _batch(a, _ck(bytes=BIG))),
    ("ckpt-lineage-long", "lineage", lambda a: _batch(a, _ck(lineage="l" * 300))),
    ("ckpt-lineage-nul", "lineage", lambda a: _batch(a, _ck(lineage="l\x00"))),
    ("ckpt-save_s-nan", "save_s", lambda a: _batch(a, _ck(save_s=NAN))),
    ("hb-state-nul", "state", lambda a: _batch(a, _hb(state="r\x00"))),
    ("hb-disk-2^63", "disk_free_bytes", lambda a: _batch(a, _hb(disk_free_bytes=BIG))),
    ("hb-disk_total-2^63", "disk_total_bytes", lambda a: _batch(a, _hb(disk_total_bytes=BIG))),
    ("exit-code-2^63", "exit_code", lambda a: _batch(a, _exit(exit_code=BIG))),
    ("exit-code-2^31", "exit_code", lambda a: _batch(a, _exit(exit_code=BIG32))),
    ("exit-signal-2^63", "signal", lambda a: _batch(a, _exit(signal=BIG))),
    ("exit-failed-rank-2^31", "rank",
     lambda a: _batch(a, _exit(failed_ranks=[{"rank": BIG32, "exit_code": 1}]))),
    ("exit-failed-code-2^63", "exit_code",
     lambda a: _batch(a, _exit(failed_ranks=[{"rank": 0, "exit_code": BIG}]))),
    ("result-id-2^63", "command_id", lambda a: _batch(a, _res(command_id=BIG))),
    ("result-id-2^31", "command_id", lambda a: _batch(a, _res(command_id=BIG32))),
]

OPERATOR_POSTS = [
    ("rollback-checkpoint-2^63", "checkpoint", "rollback", {"checkpoint": BIG}),
    ("rollback-checkpoint-2^31", "checkpoint", "rollback", {"checkpoint": BIG32}),
    ("rollback-step-2^31", "step", "rollback", {"step": BIG32}),
    ("rollback-skip-2^63", "skip", "rollback", {"step": 100, "skip": [[0, BIG]]}),
    ("rollback-reason-nul", "reason", "rollback", {"step": 100, "reason": "r\x00"}),
    ("restart-reason-nul", "reason", "restart", {"reason": "r\x00"}),
    ("restart-checkpoint-nul", "checkpoint", "restart", {"checkpoint": "/ck/\x00"}),
    ("stop-reason-nul", "reason", "stop", {"reason": "r\x00"}),
    ("stop-reason-esc", "reason", "stop", {"reason": "\x1b[2J"}),
]

QUERIES = [
    ("steps-from-2^63", "from", f"/api/v1/runs/r1/steps?from={BIG}"),
    ("steps-to-2^63", "to", f"/api/v1/runs/r1/steps?to={BIG}"),
    ("steps-from-2^31", "from", f"/api/v1/runs/r1/steps?from={BIG32}"),
    ("steps-attempt-2^63", "attempt", f"/api/v1/runs/r1/steps?attempt={BIG}"),
    ("steps-attempt-2^31", "attempt", f"/api/v1/runs/r1/steps?attempt={BIG32}"),
    ("steps-max_points-2^63", "max_points", f"/api/v1/runs/r1/steps?max_points={BIG}"),
    ("checkpoints-limit-2^63", "limit", f"/api/v1/runs/r1/checkpoints?limit={BIG}"),
    ("action-2^63", "action_id", f"/api/v1/actions/{BIG}"),
    ("action-2^31", "action_id", f"/api/v1/actions/{BIG32}"),
    ("run-nul", "run", "/api/v1/runs/r%001"),
    ("run-nul-steps", "run", "/api/v1/runs/r%00/steps"),
    ("run-long", "run", "/api/v1/runs/" + "r" * 300),
]


def _post(client: TestClient, path: str, body: Any, headers: dict[str, str]) -> Any:
    # json.dumps, not httpx's json=: the hostile values include NaN tokens.
    return client.post(path, content=json.dumps(body),
                       headers={**headers, "content-type": "application/json"})


def assert_refused(r: Any, field: str) -> None:
    assert r.status_code == 422, r.text
    body = r.json()
    assert isinstance(body["detail"], str)
    assert field in body["detail"], body["detail"]
    assert any(field in e["loc"] for e in body["errors"]), body["errors"]


@dataclass
class Seeded:
    client: TestClient
    db: Database
    agent_id: int
    before: dict[str, list[str]]


@pytest.fixture(scope="module", params=BACKENDS)
def seeded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Seeded]:
    """One store per backend for all the hostile requests of this module (each one stores
    nothing, which every test checks): run r1 with two steps and a checkpoint at step 100
    (agent seq 0 stored), and the store as it is then."""
    if request.param == "sqlite":
        database = make_database(f"sqlite:///{tmp_path_factory.mktemp('bounds') / 'b.db'}")
        metadata.create_all(database.engine)
    else:
        database = make_database(request.getfixturevalue("pg_tables_url"))
        names = ", ".join(t.name for t in metadata.sorted_tables)
        with database.engine.begin() as c:
            c.execute(text(f"TRUNCATE {names} RESTART IDENTITY CASCADE"))
    app = create_app(make_settings(), db=database, clock=FakeClock(), upgrade_schema=False,
                     start_evaluator=False)
    try:
        with TestClient(app) as client:
            aid = register(client)["agent_id"]
            ingest(client, aid, 0, [step(0, 100), step(1, 100), _ck(step=100, path="/ck/100")])
            yield Seeded(client, database, aid, store_snapshot(database))
    finally:
        database.dispose()


@pytest.mark.parametrize(("field", "body"), [c[1:] for c in REGISTER],
                         ids=[c[0] for c in REGISTER])
def test_hostile_registration_is_422_and_stores_nothing(
        seeded: Seeded, field: str, body: Any) -> None:
    assert_refused(_post(seeded.client, "/api/v1/agents/register", body, AGENT), field)
    assert store_snapshot(seeded.db) == seeded.before


@pytest.mark.parametrize(("field", "build"), [c[1:] for c in INGEST],
                         ids=[c[0] for c in INGEST])
def test_hostile_batch_is_422_and_stores_nothing(
        seeded: Seeded, field: str, build: Any) -> None:
    assert_refused(_post(seeded.client, "/api/v1/ingest", build(seeded.agent_id), AGENT), field)
    assert store_snapshot(seeded.db) == seeded.before


@pytest.mark.parametrize(("field", "route", "body"), [c[1:] for c in OPERATOR_POSTS],
                         ids=[c[0] for c in OPERATOR_POSTS])
def test_hostile_operator_request_is_422_and_stores_nothing(
        seeded: Seeded, field: str, route: str, body: Any) -> None:
    assert_refused(_post(seeded.client, f"/api/v1/runs/r1/{route}", body, OPERATOR), field)
    assert store_snapshot(seeded.db) == seeded.before


@pytest.mark.parametrize(("field", "url"), [c[1:] for c in QUERIES],
                         ids=[c[0] for c in QUERIES])
def test_hostile_query_and_path_parameters_are_422(
        seeded: Seeded, field: str, url: str) -> None:
    assert_refused(seeded.client.get(url, headers=OPERATOR), field)
    assert store_snapshot(seeded.db) == seeded.before


@pytest.mark.parametrize("page", ["/runs/r%00", "/runs/r%00/tables",
                                  "/dashboard/api/runs/r%00/state",
                                  "/dashboard/api/runs/r%00/series"])
def test_a_nul_in_a_dashboard_run_name_is_an_unknown_run(seeded: Seeded, page: str) -> None:
    r = seeded.client.get(page, headers=OPERATOR)
    assert r.status_code == 404, r.text


def test_the_bounds_leave_real_values_alone(client: TestClient, db: Database) -> None:
    """The largest values the store holds, a NaN loss and an Infinity grad norm, multi-line
    text: all stored."""
    aid = register(client)["agent_id"]
    top = 2**31 - 1
    items = [step(0, top, loss=NAN, grad_norm=INF, batch_index=2**63 - 1, pid=top),
             _ev(message="line one\n\tline two\r\n", step=top),
             _ck(step=top, bytes=2**63 - 1, lineage="l" * 200),
             _hb(disk_free_bytes=2**63 - 1, disk_total_bytes=2**63 - 1),
             _exit(exit_code=-9, signal=9)]
    r = _post(client, "/api/v1/ingest", _batch(aid, *items, seq=2**63 - 1, dropped=top),
              as_agent(client, aid))
    assert r.status_code == 200, r.text
    pts = client.get(f"/api/v1/runs/r1/steps?from={top}&to={top}", headers=OPERATOR).json()
    assert pts["points"][0]["loss_nonfinite"] == 1

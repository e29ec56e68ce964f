"""Checkpoint claims are checked: an agent registers its checkpoint roots, and every
checkpoint path it reports must normalise to a path strictly inside one of them, else the
batch is refused (422 naming the path and the roots) and nothing of it is stored.  Operators
name checkpoints by id or step, never by a path."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from tests.supervisor.sup_helpers import (
    AGENT,
    OPERATOR,
    FakeClock,
    command_rows,
    count_rows,
    crash,
    ingest,
    register,
    run_with_checkpoints,
    step,
)
from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store import ingest as store_ingest
from trainwarden.supervisor.store import tables
from trainwarden.supervisor.store.db import Database


def ckpt(path: str, s: int = 5) -> dict[str, Any]:
    return {"type": "checkpoint", "step": s, "path": path, "bytes": 5, "t": 100.0,
            "lineage": "a0", "save_s": 0.1}


def run_summary(client: TestClient, run: str = "r1") -> dict[str, Any]:
    r = client.get(f"/api/v1/runs/{run}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def refused(client: TestClient, agent_id: int, seq: int, items: list[dict[str, Any]]
            ) -> str:
    body = ingest(client, agent_id, seq, items, expect=422)
    detail: str = body["detail"]
    return detail


def stored_roots(db: Database, agent_id: int) -> list[str]:
    with db.read() as conn:
        roots: list[str] = conn.execute(select(tables.agents.c.checkpoint_roots).where(
            tables.agents.c.id == agent_id)).scalar_one()
    return roots


# ---- registration ---------------------------------------------------------------------------


def test_registration_keeps_the_roots_normalised(client: TestClient, db: Database) -> None:
    r = client.post("/api/v1/agents/register", headers=AGENT, json={
        "run": "r1", "node": "n0", "checkpoint_root": "/data//ckpt/",
        "checkpoint_roots": ["/scratch/./ck", "/data/ckpt"]})
    assert r.status_code == 200, r.text
    assert stored_roots(db, r.json()["agent_id"]) == ["/data/ckpt", "/scratch/ck"]


@pytest.mark.parametrize(("root", "why"), [
    ("ckpt", "not an absolute path"), ("/", "would admit any path"),
    ("/data/../etc", "'..'"), ("/data/\x1b[2Jck", "control character"),
])
def test_a_bad_root_is_refused_at_registration(client: TestClient, root: str,
                                               why: str) -> None:
    for body in ({"checkpoint_roots": [root]}, {"checkpoint_root": root}):
        r = client.post("/api/v1/agents/register", headers=AGENT,
                        json={"run": "r1", "node": "n0", **body})
        assert r.status_code == 422, r.text
        assert why in r.json()["detail"]
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).status_code == 404


def test_at_most_sixteen_roots(client: TestClient) -> None:
    roots = [f"/ck/{i}" for i in range(17)]
    r = client.post("/api/v1/agents/register", headers=AGENT,
                    json={"run": "r1", "node": "n0", "checkpoint_roots": roots})
    assert r.status_code == 422


# ---- checkpoint paths outside the agent's roots ---------------------------------------------


@pytest.mark.parametrize("path", ["/etc/ssh", "../../../../etc", "/ck/../etc",
                                  "/ck/step_5/../../etc/ssh"])
def test_a_checkpoint_outside_the_roots_is_refused_and_nothing_is_stored(
        client: TestClient, db: Database, evaluator: Evaluator, path: str) -> None:
    a = register(client)["agent_id"]
    ingest(client, a, 0, [step(0, s, world_size=1) for s in range(3)] + [ckpt("/ck/step_2", 2)])
    detail = refused(client, a, 1, [step(0, 3, world_size=1), ckpt(path, 99)])
    assert repr(path) in detail and "'/ck'" in detail
    with db.read() as conn:
        assert count_rows(conn, "checkpoints") == 1
        assert count_rows(conn, "rank_steps") == 3  # not the refused batch's step
        assert count_rows(conn, "ingested_batches") == 1  # its seq is not taken
    assert run_summary(client)["checkpoint"]["path"] == "/ck/step_2"
    # The crash restart resumes from the real newest checkpoint; nothing protects the other.
    ingest(client, a, 1, [crash()])
    evaluator.tick()
    with db.read() as conn:
        (cmd,) = command_rows(conn, run_summary(client)["id"])
    assert cmd["plan"]["checkpoint"] == "/ck/step_2"
    assert all(".." not in p and not p.startswith("/etc")
               for p in ingest(client, a, 2, [])["protect"])


def test_the_refusal_is_a_422_naming_the_item(client: TestClient) -> None:
    a = register(client)["agent_id"]
    body = ingest(client, a, 0, [step(0, 0, world_size=1), ckpt("/etc/ssh")], expect=422)
    (err,) = body["errors"]
    assert err["loc"] == ["body", "items", "1", "path"]
    assert err["type"] == "checkpoint_outside_roots"
    assert "not inside the agent's registered checkpoint root(s) '/ck'" in err["msg"]


def test_paths_are_stored_normalised_and_relative_ones_resolved_against_the_root(
        client: TestClient) -> None:
    a = register(client, roots=["/ck", "/scratch/ck"])["agent_id"]
    ingest(client, a, 0, [ckpt("step_1", 1), ckpt("/ck/./a//step_2", 2),
                          ckpt("/scratch/ck/step_3", 3)])
    cps = client.get("/api/v1/runs/r1/checkpoints", headers=OPERATOR).json()["checkpoints"]
    assert sorted(c["path"] for c in cps) == ["/ck/a/step_2", "/ck/step_1",
                                              "/scratch/ck/step_3"]


@pytest.mark.parametrize("path", ["/ck", "/ck/", "/ckpt/step_1", "/", ".", "/ck/.."])
def test_strictly_inside_a_root(client: TestClient, path: str) -> None:
    a = register(client)["agent_id"]
    refused(client, a, 0, [ckpt(path)])


def test_an_agent_that_registered_no_root_is_told_to_pass_one(client: TestClient) -> None:
    a = register(client, roots=[])["agent_id"]
    ingest(client, a, 0, [step(0, 0, world_size=1)])  # only checkpoints need a root
    detail = refused(client, a, 1, [ckpt("/ck/step_5")])
    assert "registered no checkpoint root" in detail and "--checkpoint-root" in detail


def test_registering_again_replaces_the_roots_and_a_replay_stays_a_duplicate(
        client: TestClient, db: Database) -> None:
    a = register(client)["agent_id"]
    ingest(client, a, 0, [ckpt("/ck/step_5")])
    assert register(client, roots=["/new"])["agent_id"] == a
    assert stored_roots(db, a) == ["/new"]
    refused(client, a, 1, [ckpt("/ck/step_6", 6)])
    assert ingest(client, a, 0, [ckpt("/ck/step_5")])["duplicate"] is True
    ingest(client, a, 1, [ckpt("/new/step_6", 6)])
    assert run_summary(client)["checkpoint"]["path"] == "/new/step_6"


def test_in_one_group_a_refused_batch_fails_alone(db: Database, clock: FakeClock) -> None:
    """The ingest writer's group commit (Postgres): a refused batch beside good ones."""
    with db.write() as conn:
        from trainwarden.supervisor.store import registry
        a = registry.register_agent(conn, req=wire.RegisterRequest(
            run="r1", node="n0", checkpoint_roots=["/ck"]), now=clock())["agent_id"]

    def batch(seq: int, path: str) -> wire.IngestBatch:
        return wire.IngestBatch.model_validate({"agent_id": a, "seq": seq, "sent_at": clock(),
                                                "items": [ckpt(path, seq)]})

    with db.write() as conn:
        out = store_ingest.ingest_batches(
            conn, batches=[batch(0, "/ck/step_0"), batch(1, "/etc/x"), batch(2, "step_2")],
            now=clock())
    assert isinstance(out[1], store_ingest.CheckpointRefused)
    assert [isinstance(r, store_ingest.IngestResult) for r in (out[0], out[2])] == [True, True]
    with db.read() as conn:
        paths = sorted(r[0] for r in conn.execute(select(tables.checkpoints.c.path)))
        seqs = sorted(r[0] for r in conn.execute(select(tables.ingested_batches.c.seq)))
    assert paths == ["/ck/step_0", "/ck/step_2"]
    assert seqs == [0, 2]


# ---- operators name checkpoints by id or step -----------------------------------------------


@pytest.mark.parametrize("route", ["restart", "rollback"])
@pytest.mark.parametrize("body", [{"checkpoint": "/etc/ssh"}, {"checkpoint": "../../etc"},
                                  {"path": "/ck/step_50"}])
def test_an_operator_free_path_is_refused(client: TestClient, db: Database, route: str,
                                          body: dict[str, Any]) -> None:
    run_with_checkpoints(client)
    r = client.post(f"/api/v1/runs/r1/{route}", headers=OPERATOR, json=body)
    assert r.status_code == 422, r.text
    assert "by its id" in r.text and "never by a path" in r.text
    with db.read() as conn:
        assert count_rows(conn, "actions") == 0


def test_an_operator_restart_names_a_known_checkpoint(
        client: TestClient, db: Database) -> None:
    a = run_with_checkpoints(client)
    r = client.post("/api/v1/runs/r1/restart", headers=OPERATOR, json={"step": 77})
    assert r.status_code == 404 and "no checkpoint at step 77" in r.json()["detail"]
    cps = client.get("/api/v1/runs/r1/checkpoints", headers=OPERATOR).json()["checkpoints"]
    by_step = {c["step"]: c["id"] for c in cps}
    r = client.post("/api/v1/runs/r1/restart", headers=OPERATOR,
                    json={"checkpoint": by_step[50], "reason": "back to 50"})
    assert r.status_code == 200, r.text
    (cmd,) = ingest(client, a, 1, [])["commands"]
    assert cmd["plan"]["checkpoint"] == "/ck/step_50"
    # The branch beyond it is abandoned: the newest checkpoint is 50 now, not 125.
    assert run_summary(client)["checkpoint"]["step"] == 50
    r = client.post("/api/v1/runs/r1/restart", headers=OPERATOR, json={"step": 125})
    assert r.status_code == 422 and "abandoned" in r.json()["detail"]


def test_an_operator_restart_by_default_takes_the_newest(client: TestClient) -> None:
    a = run_with_checkpoints(client)
    r = client.post("/api/v1/runs/r1/restart", headers=OPERATOR, json={})
    assert r.status_code == 200, r.text
    (cmd,) = ingest(client, a, 1, [])["commands"]
    assert cmd["plan"]["checkpoint"] == "/ck/step_125"

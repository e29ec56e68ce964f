"""Trust: no value an agent sends reaches a store, a page or a tick unclean; one run's failure
never stops the evaluator for the others; a token's scope holds on every route; only members
steer a run.  On SQLite and Postgres."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy import text

from tests.supervisor.sup_helpers import (
    ADMIN,
    ADMIN_TOKEN,
    AGENT,
    OPERATOR,
    FakeClock,
    as_agent,
    crash,
    ingest,
    make_settings,
    register,
    step,
    store_snapshot,
)
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Database


@pytest.fixture
def app(db: Database, clock: FakeClock) -> FastAPI:
    return create_app(make_settings(admin_token=ADMIN_TOKEN), db=db, clock=clock,
                      upgrade_schema=False, start_evaluator=False)


@pytest.fixture
def client(app: FastAPI) -> Iterator[TestClient]:
    # A 500 must come back as a 500 (what a user gets), not as an exception in the test.
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c


@pytest.fixture
def evaluator(app: FastAPI) -> Evaluator:
    ev: Evaluator = app.state.evaluator
    return ev


def _get(client: TestClient, path: str, headers: dict[str, str] | None = None) -> Any:
    r = client.get(path, headers=OPERATOR if headers is None else headers)
    assert r.status_code == 200, r.text
    return r.json()


def _train(client: TestClient, clock: FakeClock, agent: int, seq: int, steps: range,
           loss: Any = None) -> int:
    """One batch per step of a one-node, two-rank run (with a heartbeat, as the agent sends);
    returns the next seq."""
    for s in steps:
        clock.advance(0.5)
        lv = loss(s) if loss else 1.0
        items = [step(r, s, t=clock.now, loss=lv, world_size=2) for r in (0, 1)]
        items.append({"type": "heartbeat", "t": clock.now, "state": "running"})
        ingest(client, agent, seq, items)
        seq += 1
    return seq


def _with_checkpoint(client: TestClient, clock: FakeClock, run: str) -> tuple[int, int]:
    """A run on one node with 20 steps and a complete checkpoint at step 10."""
    a = int(register(client, run=run, node="n0")["agent_id"])
    seq = _train(client, clock, a, 0, range(0, 20))
    ingest(client, a, seq, [{"type": "checkpoint", "step": 10, "path": "/ck/step_10",
                             "bytes": 5, "t": clock.now, "lineage": "a0"}])
    return a, seq + 1


# ---- 1. no value an agent sends reaches a store, a page or a tick unclean ------------------


def test_a_nul_in_a_dying_workers_last_words_is_stored_escaped_and_the_crash_handled(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """The suite's exit report: its failed rank's message holds a NUL and an escape
    sequence.  It is stored (200) with both shown as escapes, the crash opens its incident
    and restarts the run, and the evaluator keeps ticking."""
    a, seq = _with_checkpoint(client, clock, "poison")
    ex = crash(rank=1)
    ex["failed_ranks"][0]["message"] = "boom\x00 \x1b[31mred"
    ex["failed_ranks"][0]["extra\x00key"] = "v\x00"  # a key torchrun's summary never has
    ingest(client, a, seq, [ex])
    evaluator.tick()
    (inc,) = _get(client, "/api/v1/runs/poison/incidents")["incidents"]
    assert inc["kind"] == "crash"
    assert "\x00" not in json.dumps(inc) and "\\x00" in json.dumps(inc)
    run = _get(client, "/api/v1/runs/poison")
    assert run["status"] == "restarting" and run["attempt"] == 1
    assert client.get("/runs/poison", headers=OPERATOR).status_code == 200


@pytest.mark.parametrize("where", ["event message", "event details", "command result"])
def test_control_characters_in_an_agents_free_text_are_kept_as_escapes(
        client: TestClient, where: str) -> None:
    a = int(register(client, run="r1", node="n0")["agent_id"])
    hostile = "x\x00y\x1b]0;owned\x07z"
    item: dict[str, Any] = {
        "event message": {"type": "event", "name": "note", "t": 1.0, "message": hostile},
        "event details": {"type": "event", "name": "note", "t": 1.0,
                          "details": {"k\x00": [hostile, {"deep": hostile}]}},
        "command result": {"type": "command_result", "t": 1.0, "command_id": 1,
                           "status": "done", "detail": hostile},
    }[where]
    ingest(client, a, 0, [item])
    if where != "command result":
        (ev,) = [e for e in _get(client, "/api/v1/runs/r1/events")["events"]
                 if e["name"] == "note"]
        text = json.dumps(ev)
        assert "\\\\x00" in text and "\\\\x1b" in text and "\\u0000" not in text


def test_over_long_free_text_is_cut_with_a_marker(client: TestClient) -> None:
    a = int(register(client, run="r1", node="n0")["agent_id"])
    ingest(client, a, 0, [{"type": "event", "name": "note", "t": 1.0, "message": "m" * 20_000}])
    (ev,) = [e for e in _get(client, "/api/v1/runs/r1/events")["events"] if e["name"] == "note"]
    kept, _, marker = ev["message"].partition("... [")
    assert len(ev["message"]) <= 16_384 and marker.endswith(" characters cut]")
    assert len(kept) + int(marker.split()[0]) == 20_000 and set(kept) == {"m"}


def test_a_lone_surrogate_is_refused_cleanly_and_stores_nothing(client: TestClient,
                                                               db: Database) -> None:
    a = int(register(client, run="r1", node="n0")["agent_id"])
    before = store_snapshot(db)
    body = ('{"agent_id": ' + str(a) + ', "seq": 0, "items": [{"type": "event", '
            '"name": "note", "message": "a\\ud800b"}]}')
    r = client.post("/api/v1/ingest", content=body,
                    headers={**as_agent(client, a), "content-type": "application/json"})
    assert r.status_code == 422, r.text
    assert store_snapshot(db) == before


def test_workers_whose_cpu_adds_up_past_a_float_leave_the_pages_and_metrics_whole(
        client: TestClient) -> None:
    """Two workers at cpu_percent 1e308 (each finite, admitted): the sum overflows; the run
    page, its tables and /metrics answer 200 and show no total instead of infinity."""
    a = int(register(client, run="r1", node="n0")["agent_id"])
    workers = [{"rank": r, "pid": 10 + r, "cpu_percent": 1e308, "rss_bytes": 2**70}
               for r in (0, 1)]
    ingest(client, a, 0, [step(0, 0, world_size=2), step(1, 0, world_size=2),
                          {"type": "heartbeat", "t": 1.0, "workers": workers}])
    for path in ("/runs/r1", "/runs/r1/tables", "/api/v1/runs/r1", "/metrics"):
        r = client.get(path, headers=OPERATOR)
        assert r.status_code == 200, (path, r.text[:300])
    page = client.get("/runs/r1/tables", headers=OPERATOR).text
    assert "— CPU" in page and "inf" not in page.lower().replace("info", "")
    metrics = client.get("/metrics", headers=OPERATOR).text
    assert 'trainwarden_agent_worker_cpu_percent{node="n0",run="r1"}' not in metrics


@pytest.mark.parametrize("method, path", [
    ("POST", "/api/v1/runs/r1/nodes/a%00b/takeover"),
    ("DELETE", "/api/v1/tokens/a%00b"),
    ("GET", "/api/v1/runs/a%00b"),
    ("POST", "/api/v1/runs/a%00b/nodes/n0/takeover"),
    ("GET", "/api/v1/hosts/a%00b"),
    ("POST", "/api/v1/hosts/a%00b/cordon"),
])
def test_a_nul_in_a_path_parameter_is_a_422(client: TestClient, method: str, path: str) -> None:
    register(client, run="r1", node="n0")
    r = client.request(method, path, headers=ADMIN)
    assert r.status_code == 422, r.text


# ---- 2. an evaluator tick cannot be stopped by one run -------------------------------------


def test_a_store_error_on_one_runs_incident_leaves_the_others_judged_on_the_same_tick(
        client: TestClient, clock: FakeClock, evaluator: Evaluator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The store refuses run A's crash incident on every tick.  Run B's NaN on that same
    tick is rolled back; A's failure is an event, a count in /metrics, and is retried: once
    the store takes it, A's crash is handled."""
    a, a_seq = _with_checkpoint(client, clock, "A")
    b, b_seq = _with_checkpoint(client, clock, "B")
    runs = {r["name"]: r["id"] for r in _get(client, "/api/v1/runs")["runs"]}
    real_open = rec.open_incident

    def refusing(conn: Any, **values: Any) -> int:
        if values.get("run_id") == runs["A"]:
            # A real error of the store (on Postgres it aborts the transaction it is in).
            conn.execute(text("SELECT * FROM store_refused_the_row"))
        return real_open(conn, **values)

    monkeypatch.setattr(rec, "open_incident", refusing)
    ingest(client, a, a_seq, [crash()])
    _train(client, clock, b, b_seq, range(20, 21), loss=lambda s: float("nan"))
    evaluator.tick()
    (inc,) = _get(client, "/api/v1/runs/B/incidents")["incidents"]
    assert inc["kind"] == "nonfinite"
    assert _get(client, "/api/v1/runs/B")["status"] == "restarting"
    assert [a["kind"] for a in _get(client, "/api/v1/runs/B/actions")["actions"]] == ["restart"]
    assert _get(client, "/api/v1/runs/A/incidents")["incidents"] == []
    evaluator.tick()  # still failing: counted again, recorded once
    failed = [e for e in _get(client, "/api/v1/runs/A/events")["events"]
              if e["name"] == "judge_failed"]
    assert len(failed) == 1 and "store_refused_the_row" in failed[0]["message"]
    metrics = client.get("/metrics", headers=OPERATOR).text
    assert 'trainwarden_evaluator_run_failures_total{run="A"} 2.0' in metrics
    assert 'trainwarden_evaluator_run_failures_total{run="B"} 0.0' in metrics

    monkeypatch.setattr(rec, "open_incident", real_open)
    evaluator.tick()
    (inc,) = _get(client, "/api/v1/runs/A/incidents")["incidents"]
    assert inc["kind"] == "crash"
    assert _get(client, "/api/v1/runs/A")["status"] == "restarting"
    assert any(e["name"] == "judge_recovered"
               for e in _get(client, "/api/v1/runs/A/events")["events"])


# ---- 4. only members steer a run --------------------------------------------------------------


def _register_cmd(client: TestClient, run: str, node: str, command: list[str],
                  headers: dict[str, str] | None = None) -> Any:
    return client.post("/api/v1/agents/register", headers=headers or AGENT,
                       json={"run": run, "node": node, "hostname": f"h-{node}", "pid": 1,
                             "command": command, "nproc_per_node": 1,
                             "checkpoint_roots": ["/ck"]})


@pytest.mark.parametrize("nnodes, admitted", [
    (["--nnodes=2"], 2), (["--nnodes", "2"], 2), (["--nnodes=3:3"], 3), ([], 1)])
def test_a_node_beyond_the_world_the_members_declare_is_a_spare_and_steers_nothing(
        client: TestClient, db: Database, evaluator: Evaluator, nnodes: list[str],
        admitted: int) -> None:
    command = ["torchrun", *nnodes, "--nproc-per-node=1", "train.py", "--nnodes=99"]
    for i in range(admitted):
        r = _register_cmd(client, "r1", f"n{i}", command)
        assert r.status_code == 200 and r.json()["membership"] == {
            "role": "member", "node_rank": i, "nnodes": admitted, "epoch": 0,
            "endpoint": "testclient:29500", "declared": admitted}, r.text
    # A registration that disagrees with the world the run's first member declared is
    # refused, naming the field and both values; nothing changes.
    before = store_snapshot(db)
    r = _register_cmd(client, "r1", "extra", ["torchrun", "--nnodes=99", "train.py"])
    assert r.status_code == 409, r.text
    assert "--nnodes" in r.json()["detail"] and f"declares {admitted} node(s)" in \
        r.json()["detail"] and "declares 99" in r.json()["detail"], r.text
    assert store_snapshot(db) == before
    r = _register_cmd(client, "r1", "extra", command)
    assert r.status_code == 200, r.text
    assert r.json()["membership"]["role"] == "spare", r.text
    assert r.json()["membership"]["node_rank"] is None
    spare = {"X-Trainwarden-Agent-Credential": r.json()["credential"], **AGENT}
    before = store_snapshot(db)
    # What a spare reports for the run is not the run's: no step, checkpoint or exit is
    # stored, so nothing it says is acted on.
    batch = {"agent_id": r.json()["agent_id"], "seq": 0, "attempt": 0, "sent_at": 1.0,
             "items": [step(0, 3), crash(),
                       {"type": "checkpoint", "rank": 0, "step": 3, "path": "/ck/3",
                        "bytes": 1, "lineage": "a0", "t": 1.0}]}
    reply = client.post("/api/v1/ingest", headers=spare, json=batch)
    assert reply.status_code == 200 and reply.json()["role"] == "spare", reply.text
    evaluator.tick()
    after = store_snapshot(db)
    for table in ("rank_steps", "exits", "checkpoints", "incidents", "actions"):
        assert after.get(table) == before.get(table), table
    assert _get(client, "/api/v1/runs/r1")["status"] == "running"
    # A member registering again keeps its node rank.
    again = _register_cmd(client, "r1", "n0", command)
    assert again.status_code in (200, 409)
    if again.status_code == 200:
        assert again.json()["membership"]["node_rank"] == 0


def test_a_command_that_is_not_a_torchrun_launch_declares_no_bound(client: TestClient) -> None:
    for i in range(3):
        assert _register_cmd(client, "r1", f"n{i}", ["python", "train.py"]).status_code == 200


def test_the_token_scope_is_checked_at_ingest_as_at_registration(client: TestClient) -> None:
    def token(name: str, scope: str) -> dict[str, str]:
        r = client.post("/api/v1/tokens", headers=ADMIN,
                        json={"name": name, "role": "agent", "scope": scope})
        assert r.status_code == 201, r.text
        return {"Authorization": f"Bearer {r.json()['token']}"}

    team_a, team_b = token("a", "team-a-*"), token("b", "team-b-*")
    reg = _register_cmd(client, "team-a-1", "n0", ["torchrun", "train.py"], headers=team_a)
    assert reg.status_code == 200
    agent, cred = reg.json()["agent_id"], reg.json()["credential"]
    body = json.dumps({"agent_id": agent, "seq": 0, "items": [step(0, 0, world_size=1)]})
    headers = {"X-Trainwarden-Agent-Credential": cred, "content-type": "application/json"}
    r = client.post("/api/v1/ingest", content=body, headers={**team_b, **headers})
    assert r.status_code == 403 and "outside" in r.json()["detail"], r.text
    assert _get(client, "/api/v1/runs/team-a-1")["step"] is None
    r = client.post("/api/v1/ingest", content=body, headers={**team_a, **headers})
    assert r.status_code == 200, r.text


def test_an_ended_runs_credentials_are_revoked_once_its_agents_had_time_to_report(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    a = int(register(client, run="done", node="n0")["agent_id"])
    seq = _train(client, clock, a, 0, range(0, 3))
    ingest(client, a, seq, [{"type": "exit", "t": clock.now, "attempt": 0, "exit_code": 0,
                             "outcome": "completed", "failed_ranks": []}])
    evaluator.tick()
    assert _get(client, "/api/v1/runs/done")["status"] == "completed"
    # Within the node-lost deadline its last batches are still taken...
    clock.advance(1.0)
    evaluator.tick()
    ingest(client, a, seq + 1, [{"type": "heartbeat", "t": clock.now, "state": "finished"}])
    # ...after it, nothing the run's agents send is stored.
    clock.advance(31.0)
    evaluator.tick()
    body = json.dumps({"agent_id": a, "seq": seq + 2,
                       "items": [{"type": "heartbeat", "t": clock.now}]})
    r = client.post("/api/v1/ingest", content=body,
                    headers={**as_agent(client, a), "content-type": "application/json"})
    assert r.status_code == 403 and r.headers["x-trainwarden-credential"] == "invalid"
    again = client.post("/api/v1/agents/register", headers=as_agent(client, a),
                        json={"run": "done", "node": "n0"})
    assert again.status_code == 409 and "completed" in again.json()["detail"]
    (ev,) = [e for e in _get(client, "/api/v1/runs/done/events")["events"]
             if e["name"] == "credentials_revoked"]
    assert ev["details"]["agents"] == [a]


def test_an_agent_still_leaving_an_ended_run_keeps_its_credential_until_it_has_stopped(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """The run completed: the spare is told to stop (the stop says how the run ended), and
    while it is heard from and has not finished that stop, nothing is revoked."""
    a = int(register(client, run="done", node="n0", nnodes=1)["agent_id"])
    s = int(register(client, run="done", node="s0", nnodes=1, spare=True)["agent_id"])
    seq = _train(client, clock, a, 0, range(0, 3))
    ingest(client, a, seq, [{"type": "exit", "t": clock.now, "attempt": 0, "exit_code": 0,
                             "outcome": "completed", "failed_ranks": []}])
    evaluator.tick()
    assert _get(client, "/api/v1/runs/done")["status"] == "completed"
    (cmd,) = ingest(client, s, 0, [{"type": "heartbeat", "t": clock.now,
                                    "state": "spare"}])["commands"]
    assert cmd["kind"] == "stop" and cmd["plan"] == {"run_status": "completed"}, cmd
    for i in range(1, 5):  # a slow spare: heard from, its stop not finished
        clock.advance(10.0)
        ingest(client, s, i, [{"type": "heartbeat", "t": clock.now, "state": "spare"}])
        evaluator.tick()
    names = [e["name"] for e in _get(client, "/api/v1/runs/done/events")["events"]]
    assert "credentials_revoked" not in names
    ingest(client, s, 5, [{"type": "command_result", "t": clock.now, "command_id": cmd["id"],
                           "status": "done", "detail": "workers stopped"},
                          {"type": "heartbeat", "t": clock.now, "state": "stopped"}])
    evaluator.tick()
    (ev,) = [e for e in _get(client, "/api/v1/runs/done/events")["events"]
             if e["name"] == "credentials_revoked"]
    assert sorted(ev["details"]["agents"]) == sorted([a, s])


@pytest.mark.parametrize("root", ["/etc", "/etc/trainwarden", "/usr/local/ck", "/proc/1",
                                  "/sys", "/boot", "/dev/shm/ck", "/bin", "/root", "/home",
                                  "/tmp", "/var"])
def test_system_directories_are_refused_as_checkpoint_roots(
        client: TestClient, db: Database, root: str) -> None:
    before = store_snapshot(db)
    r = client.post("/api/v1/agents/register", headers=AGENT,
                    json={"run": "r1", "node": "n0", "checkpoint_roots": [root]})
    assert r.status_code == 422 and "checkpoint_roots" in r.text, r.text
    assert store_snapshot(db) == before


@pytest.mark.parametrize("root", ["/data/ckpt", "/root/runs/ck", "/home/u/ck", "/tmp/x/ck",
                                  "/var/tmp/ck"])
def test_a_runs_own_directory_is_a_checkpoint_root(client: TestClient, root: str) -> None:
    assert register(client, roots=[root])["agent_id"]


def test_the_supervisor_confines_checkpoint_roots_to_its_allowed_directories(
        db: Database, clock: FakeClock) -> None:
    app = create_app(make_settings(auth={"checkpoint_roots_allowed": "/data/ckpt:/scratch/"}),
                     db=db, clock=clock, upgrade_schema=False, start_evaluator=False)
    with TestClient(app) as client:
        assert register(client, node="n0", roots=["/data/ckpt/run1", "/scratch"])["agent_id"]
        before = store_snapshot(db)
        r = client.post("/api/v1/agents/register", headers=AGENT,
                        json={"run": "r1", "node": "n1",
                              "checkpoint_roots": ["/scratch/a", "/srv/ck"]})
        assert r.status_code == 422 and "'/srv/ck' is outside" in r.json()["detail"], r.text
        assert store_snapshot(db) == before


def test_an_allowed_directory_must_be_absolute() -> None:
    with pytest.raises(ValueError, match="not an absolute path"):
        make_settings(auth={"checkpoint_roots_allowed": "/data:scratch"})


# ---- 5. the takeover route addresses any node name the registration accepts ----------------


def test_the_takeover_route_addresses_a_node_whose_name_holds_a_slash(
        client: TestClient) -> None:
    a = int(register(client, run="r1", node="rack1/n0")["agent_id"])
    r = client.post("/api/v1/runs/r1/nodes/rack1/n0/takeover", headers=OPERATOR)
    assert r.status_code == 200, r.text
    assert r.json()["node"] == "rack1/n0" and r.json()["agent_id"] == a
    body = json.dumps({"agent_id": a, "seq": 0, "items": []})
    refused = client.post("/api/v1/ingest", content=body,
                          headers={**as_agent(client, a), "content-type": "application/json"})
    assert refused.status_code == 403
    r = client.post("/api/v1/runs/r1/nodes/rack1/nobody/takeover", headers=OPERATOR)
    assert r.status_code == 404 and "'rack1/nobody'" in r.json()["detail"]


def test_an_out_of_scope_operator_cannot_take_over_a_node(client: TestClient) -> None:
    register(client, run="victim-op", node="v0")
    r = client.post("/api/v1/tokens", headers=ADMIN,
                    json={"name": "att", "role": "operator", "scope": "attacker-*"})
    tok = {"Authorization": f"Bearer {r.json()['token']}"}
    r = client.post("/api/v1/runs/victim-op/nodes/v0/takeover", headers=tok)
    assert r.status_code == 403 and "outside" in r.json()["detail"]
    assert register(client, run="victim-op", node="v0")["agent_id"]  # still its node

"""Trust across runs, on SQLite and Postgres, through the real app: what a token can change is
bounded by its scope, hosts included (a run-scoped agent cordons a node in its own run only);
only members' evidence moves a run; the run's settings are its first member's; the declared
world is bounded and costs nothing until nodes register; a supervisor may admit run-scoped
agent tokens only."""

from __future__ import annotations

import gc
import time
import tracemalloc
from typing import Any

import pytest
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
    step,
    store_snapshot,
)
from trainwarden.agent.core.launch import MAX_NNODES
from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.ledger import GPU_EVERY_S
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store import hosts
from trainwarden.supervisor.store.db import Database

CRED = "X-Trainwarden-Agent-Credential"


@pytest.fixture
def settings() -> SupervisorSettings:
    """The conftest's app, client and evaluator, with an admin token (tokens are minted)."""
    return make_settings(admin_token=ADMIN_TOKEN)


def token(client: TestClient, name: str, role: str, scope: str | None) -> dict[str, str]:
    body: dict[str, Any] = {"name": name, "role": role}
    if scope is not None:
        body["scope"] = scope
    r = client.post("/api/v1/tokens", headers=ADMIN, json=body)
    assert r.status_code in (200, 201), r.text
    return {"Authorization": f"Bearer {r.json()['token']}"}


def join(client: TestClient, run: str, node: str, headers: dict[str, str],
         command: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    r = client.post("/api/v1/agents/register", headers=headers, json={
        "run": run, "node": node, "hostname": node, "pid": 1,
        "command": command or ["torchrun", "--nnodes=2", "train.py"], "nproc_per_node": 1,
        "checkpoint_roots": ["/ck"], **extra})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    out["headers"] = {**headers, CRED: out["credential"]}
    return out


def send(client: TestClient, agent: dict[str, Any], seq: int, items: list[dict[str, Any]],
         expect: int = 200) -> None:
    r = client.post("/api/v1/ingest", headers=agent["headers"], json={
        "agent_id": agent["agent_id"], "seq": seq, "attempt": 0, "sent_at": 1.0,
        "items": items})
    assert r.status_code == expect, r.text


def preflight(clock: FakeClock, passed: bool) -> dict[str, Any]:
    return {"type": "event", "attempt": 0, "rank": 0, "t": clock.now, "name": "preflight",
            "message": "", "details": {"passed": passed,
                                       **({} if passed else {"failed": "gpu_memory"})}}


def ecc_beat(clock: FakeClock, count: int) -> dict[str, Any]:
    return {"type": "heartbeat", "t": clock.now, "state": "running",
            "gpus": {"available": True, "devices": [{"index": 0, "ecc_uncorrected": count}]}}


def host_state(client: TestClient, node: str) -> str:
    r = client.get(f"/api/v1/hosts/{node}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return str(r.json()["state"])


def victim(client: TestClient) -> dict[str, dict[str, Any]]:
    """Run ``victim`` on gpu-17 and gpu-18 with a spare gpu-19, its agents on the cluster's
    agent token (scoped to no run)."""
    return {n: join(client, "victim", n, AGENT, spare=(n == "gpu-19"))
            for n in ("gpu-17", "gpu-18", "gpu-19")}


def victim_rows(db: Database) -> dict[str, list[str]]:
    """What another run's evidence must never change: the shared ledger and the victim's
    rows."""
    snap = store_snapshot(db)
    return {t: snap.get(t, []) for t in ("hosts", "runs", "agents", "actions", "incidents")}


# ---- 1. a token's scope bounds what it changes, hosts included -------------------------------


def test_a_run_scoped_agent_cordons_a_node_in_its_own_run_only(
        client: TestClient, db: Database, clock: FakeClock, evaluator: Evaluator) -> None:
    victim(client)
    evaluator.tick()
    before = victim_rows(db)
    attacker = token(client, "attacker", "agent", "attacker-*")
    a = join(client, "attacker-1", "gpu-17", attacker,
             command=["torchrun", "--nnodes=1", "train.py"])
    send(client, a, 0, [preflight(clock, passed=False)])
    clock.advance(GPU_EVERY_S + 1)
    send(client, a, 1, [ecc_beat(clock, 3)])
    evaluator.tick()
    clock.advance(GPU_EVERY_S + 1)
    send(client, a, 2, [ecc_beat(clock, 9)])
    evaluator.tick()
    # The shared ledger and every row of the victim's run: unchanged, on a second look.
    assert host_state(client, "gpu-17") == "healthy"
    listed = {h["node"]: h for h in client.get("/api/v1/hosts", headers=OPERATOR).json()["hosts"]}
    assert listed["gpu-17"]["state"] == "healthy" and listed["gpu-17"]["evidence_count"] == 0
    after = victim_rows(db)
    assert {t: r for t, r in after.items() if t not in ("runs", "agents")} == \
        {t: r for t, r in before.items() if t not in ("runs", "agents")}
    with db.read() as conn:
        runs = {r["name"]: r["id"] for r in
                [dict(x) for x in conn.exec_driver_sql("SELECT name, id FROM runs").mappings()]}
        # The evidence counts against the node in the attacker's own run, which replaces it.
        assert set(hosts.run_cordons(conn, run_id=runs["attacker-1"])) == {"gpu-17"}
        assert hosts.run_cordons(conn, run_id=runs["victim"]) == {}
        assert "gpu-17" not in hosts.cordoned_nodes(conn)
        kinds = [(x["kind"], x["run_id"]) for x in hosts.host_actions(conn, "gpu-17")]
    assert kinds == [("run_cordon", runs["attacker-1"])]
    # The victim's next restart keeps gpu-17 at its node rank (its spare takes nothing).
    plan = _restart_plan(client, clock, evaluator)
    assert plan["members"] == {"gpu-17": 0, "gpu-18": 1}, plan


def _restart_plan(client: TestClient, clock: FakeClock, evaluator: Evaluator) -> Any:
    """The membership of the victim's next restart (an operator's)."""
    r = client.post("/api/v1/runs/victim/restart", headers=OPERATOR, json={"reason": "test"})
    assert r.status_code in (200, 202), r.text
    evaluator.tick()
    action = client.get(f"/api/v1/actions/{r.json()['action_id']}", headers=OPERATOR).json()
    return action["plan"]["membership"]


def test_an_unscoped_agent_is_trusted_for_its_host(
        client: TestClient, db: Database, clock: FakeClock, evaluator: Evaluator) -> None:
    """The default a user gets: the cluster's agent token, scoped to no run, moves the
    shared ledger (a failed preflight cordons the host for every run)."""
    v = victim(client)
    send(client, v["gpu-17"], 0, [preflight(clock, passed=False)])
    evaluator.tick()
    assert host_state(client, "gpu-17") == "cordoned"
    other = join(client, "other", "gpu-17", AGENT, command=["torchrun", "--nnodes=1",
                                                             "train.py"])
    assert other["membership"]["role"] == "member"
    with db.read() as conn:
        assert "gpu-17" in hosts.cordoned_nodes(conn)


def _sdc_evidence_against_a_trusted_node(client: TestClient, clock: FakeClock,
                                         evaluator: Evaluator, reporter: dict[str, str]
                                         ) -> dict[str, Any]:
    """Run ``sdc-1``: gpu-30 (the cluster's agent token) holds rank 0, gpu-31 (``reporter``'s
    token) rank 1 and reports that rank 0's parameters disagree with the majority's."""
    accused = join(client, "sdc-1", "gpu-30", AGENT)
    claimant = join(client, "sdc-1", "gpu-31", reporter)
    send(client, accused, 0, [{**step(0, 10), "t": clock.now}])
    send(client, claimant, 0, [{**step(1, 10), "t": clock.now}])
    send(client, claimant, 1, [{
        "type": "event", "attempt": 0, "rank": 1, "t": clock.now, "step": 100,
        "name": "replica_mismatch", "message": "replicas disagree",
        "details": {"corrupt": [0], "suspects": [], "first_disagreement": 100,
                    "last_agreed_step": 50}}])
    evaluator.tick()
    evaluator.tick()
    incidents = client.get("/api/v1/runs/sdc-1/incidents", headers=OPERATOR).json()["incidents"]
    assert [(i["kind"], i["node"]) for i in incidents] == [
        ("silent_data_corruption", "gpu-30")], incidents
    hosts_listed = client.get("/api/v1/hosts", headers=OPERATOR).json()["hosts"]
    return {h["node"]: h for h in hosts_listed}


def test_a_run_scoped_agent_s_corruption_claim_is_no_evidence_against_another_host(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """A replica mismatch names another node's rank: an agent on a run-scoped token cannot
    move the shared ledger against a host trusted for itself."""
    scoped = token(client, "sdc-job", "agent", "sdc-*")
    listed = _sdc_evidence_against_a_trusted_node(client, clock, evaluator, scoped)
    assert listed.get("gpu-30", {}).get("evidence_count", 0) == 0, listed


def test_a_trusted_agent_s_corruption_claim_is_evidence_against_the_host(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    """The sibling with the default a user gets: both agents on the cluster's token."""
    listed = _sdc_evidence_against_a_trusted_node(client, clock, evaluator, AGENT)
    assert listed["gpu-30"]["evidence_count"] == 1, listed


def test_a_run_scoped_passed_preflight_ends_no_probation(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    v = victim(client)
    for what in ("cordon", "uncordon"):
        r = client.post(f"/api/v1/hosts/gpu-17/{what}", headers=OPERATOR,
                        json={"reason": "ops"})
        assert r.status_code == 200, r.text
    assert host_state(client, "gpu-17") == "probation"
    a = join(client, "attacker-1", "gpu-17", token(client, "attacker", "agent", "attacker-*"),
             command=["torchrun", "--nnodes=1", "train.py"])
    clock.advance(1)
    send(client, a, 0, [preflight(clock, passed=True)])
    evaluator.tick()
    assert host_state(client, "gpu-17") == "probation"
    # The host's own (trusted) agent passing one ends it.
    send(client, v["gpu-17"], 0, [preflight(clock, passed=True)])
    evaluator.tick()
    assert host_state(client, "gpu-17") == "healthy"


# ---- 2. only members' evidence moves a run --------------------------------------------------


def test_a_spare_collective_timeout_is_recorded_and_never_restarts_the_run(
        client: TestClient, db: Database, clock: FakeClock, evaluator: Evaluator) -> None:
    n0 = register(client, node="n0")["agent_id"]
    register(client, node="n1")
    ingest(client, n0, 0, [step(r, s) for s in range(5) for r in (0, 1)])
    evaluator.tick()
    extra = join(client, "r1", "intruder", AGENT)  # the world is full: a spare
    assert extra["membership"]["role"] == "spare"
    before = {t: r for t, r in store_snapshot(db).items()
              if t in ("incidents", "actions", "host_evidence", "hosts")}
    send(client, extra, 0, [{"type": "event", "attempt": 0, "rank": 0, "t": clock.now,
                             "name": "collective_timeout", "step": 5,
                             "message": "allreduce timed out",
                             "details": {"collective": "allreduce"}},
                            preflight(clock, passed=False)])
    evaluator.tick()
    after = {t: r for t, r in store_snapshot(db).items()
             if t in ("incidents", "actions", "host_evidence", "hosts")}
    assert after == before
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["status"] == "running" and run["attempt"] == 0
    events = client.get("/api/v1/runs/r1/events", headers=OPERATOR).json()["events"]
    timeout = [e for e in events if e["name"] == "collective_timeout"]
    assert len(timeout) == 1 and timeout[0]["member"] is False
    # The same event from a member restarts the run (the sibling: members do move it).
    ingest(client, n0, 1, [{"type": "event", "attempt": 0, "rank": 0, "t": clock.now,
                            "name": "collective_timeout", "step": 5, "message": "timed out",
                            "details": {"collective": "allreduce"}}])
    evaluator.tick()
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).json()["status"] == "restarting"


# ---- 3. run-level settings are the run's ------------------------------------------------------


def test_min_nodes_and_the_world_are_fixed_by_the_first_member(
        client: TestClient, db: Database) -> None:
    register(client, node="n0", nnodes=2)
    before = store_snapshot(db)
    for kw, field, values in (({"spare": True, "min_nodes": 1}, "min_nodes",
                               ("none (it never shrinks)", "asks 1")),
                              ({"min_nodes": 1}, "min_nodes", ("none", "asks 1"))):
        r = client.post("/api/v1/agents/register", headers=AGENT, json={
            "run": "r1", "node": "n9", "command": ["torchrun", "--nnodes=2", "train.py"],
            "checkpoint_roots": ["/ck"], **kw})
        assert r.status_code == 409, r.text
        assert field in r.json()["detail"] and all(v in r.json()["detail"] for v in values)
        assert store_snapshot(db) == before
    r = client.post("/api/v1/agents/register", headers=AGENT, json={
        "run": "r1", "node": "n9", "command": ["python", "train.py"],
        "checkpoint_roots": ["/ck"]})
    assert r.status_code == 409 and "torchrun" in r.json()["detail"], r.text
    # A registration that gives no --min-nodes takes the run's.
    register(client, node="n1", nnodes=2)
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).json()["membership"][
        "min_nodes"] is None
    # A run whose first member allows shrinking keeps its value.
    register(client, run="r2", node="n0", nnodes=2, min_nodes=1)
    register(client, run="r2", node="n1", nnodes=2, min_nodes=2, expect=409)
    register(client, run="r2", node="n1", nnodes=2)
    assert client.get("/api/v1/runs/r2", headers=OPERATOR).json()["membership"][
        "min_nodes"] == 1


@pytest.mark.parametrize("command", [["torchrun", "--nnodes=2", "train.py"],
                                     ["python", "train.py"]])
def test_a_spare_never_creates_a_running_run(
        client: TestClient, evaluator: Evaluator, command: list[str]) -> None:
    s = join(client, "r1", "spare-0", AGENT, command=command, spare=True)
    assert s["membership"]["role"] == "spare"
    evaluator.tick()
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["status"] == "pending", run
    member = join(client, "r1", "n0", AGENT, command=command)
    assert member["membership"]["role"] == "member"
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).json()["status"] == "running"


# ---- 4. work bounded by what exists -----------------------------------------------------------


@pytest.mark.parametrize("nnodes", [str(MAX_NNODES + 1), "1000000000", "9223372036854775808",
                                    "0", "-1", "2:9223372036854775808"])
def test_a_declared_world_beyond_the_bound_is_refused(
        client: TestClient, db: Database, nnodes: str) -> None:
    before = store_snapshot(db)
    r = client.post("/api/v1/agents/register", headers=AGENT, json={
        "run": "r1", "node": "n0", "command": ["torchrun", f"--nnodes={nnodes}", "train.py"],
        "checkpoint_roots": ["/ck"]})
    assert r.status_code == 422, r.text
    assert "--nnodes" in r.json()["detail"], r.text
    assert store_snapshot(db) == before


def _cost(client: TestClient, evaluator: Evaluator, clock: FakeClock, run: str, nnodes: int,
          other: dict[str, Any], seq: int) -> tuple[int, float]:
    """Peak Python memory (bytes) of registering one node of a ``nnodes`` world, a tick, the
    run's page data and a scrape; and the seconds another run's ingest then takes."""
    gc.collect()
    tracemalloc.start()
    join(client, run, "n0", AGENT, command=["torchrun", f"--nnodes={nnodes}", "train.py"])
    clock.advance(1)
    evaluator.tick()
    for path in (f"/api/v1/runs/{run}", "/api/v1/runs", f"/dashboard/api/runs/{run}/state",
                 f"/runs/{run}", "/metrics"):
        assert client.get(path, headers=OPERATOR).status_code == 200, path
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    t0 = time.perf_counter()
    send(client, other, seq, [step(0, seq)])
    return peak, time.perf_counter() - t0


def test_the_declared_world_at_the_bound_costs_what_a_small_one_does(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    other = join(client, "busy", "b0", AGENT, command=["torchrun", "--nnodes=1", "train.py"])
    send(client, other, 0, [step(0, 0)])
    small, small_s = _cost(client, evaluator, clock, "small", 2, other, 1)
    big, big_s = _cost(client, evaluator, clock, "big", MAX_NNODES, other, 2)
    # Flat: a generous bound (a world enumerated would be ~10 MiB at the bound).
    assert big - small < 4 * 2**20, (small, big)
    assert big_s < max(1.0, 20 * small_s), (small_s, big_s)
    m = client.get("/api/v1/runs/big", headers=OPERATOR).json()["membership"]
    assert m["nnodes"] == MAX_NNODES and m["missing_count"] == MAX_NNODES - 1
    assert len(m["missing"]) <= 64


# ---- 5. the shared agent token may be turned off ----------------------------------------------


def test_scoped_agents_only_refuses_the_bootstrap_agent_token() -> None:
    with pytest.raises(ValueError, match="agent_token must be unset with scoped_agents_only"):
        make_settings(auth={"scoped_agents_only": True})


def test_scoped_agents_only_admits_run_scoped_agent_tokens_only(
        db: Database, clock: FakeClock) -> None:
    app = create_app(make_settings(agent_token=None, admin_token=ADMIN_TOKEN,
                                   auth={"scoped_agents_only": True}),
                     db=db, clock=clock, upgrade_schema=False, start_evaluator=False)
    with TestClient(app, raise_server_exceptions=False) as client:
        before = store_snapshot(db)
        wide = token(client, "wide", "agent", None)
        assert store_snapshot(db) != before
        before = store_snapshot(db)
        for headers in (wide, AGENT):
            r = client.post("/api/v1/agents/register", headers=headers, json={
                "run": "team-a-1", "node": "n0", "command": ["python", "train.py"]})
            assert r.status_code in (401, 403), r.text
        assert "scoped_agents_only" in client.post(
            "/api/v1/agents/register", headers=wide,
            json={"run": "team-a-1", "node": "n0"}).json()["detail"]
        after = store_snapshot(db)
        assert {t: r for t, r in after.items() if t != "api_tokens"} == \
            {t: r for t, r in before.items() if t != "api_tokens"}  # (last_used_at moves)
        mine = token(client, "job-1", "agent", "team-a-1")
        a = join(client, "team-a-1", "n0", mine, command=["python", "train.py"])
        send(client, a, 0, [step(0, 0)])
        r = client.post("/api/v1/agents/register", headers=mine, json={
            "run": "team-b-1", "node": "n0", "command": ["python", "train.py"]})
        assert r.status_code == 403, r.text


def test_a_job_token_minted_as_the_security_page_shows(
        tmp_path: Any, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The security page's per-job flow, literally: a supervisor with
    TRAINWARDEN_AUTH_SCOPED_AGENTS_ONLY=true, `trainwarden token create ... --quiet` printing
    the secret alone, the job's agent registering with it, and `token revoke` ending it."""
    import httpx

    from tests.dashboard.browser import serve_in_thread
    from trainwarden.supervisor.cli import main as cli

    monkeypatch.setenv("TRAINWARDEN_AUTH_SCOPED_AGENTS_ONLY", "true")
    monkeypatch.setenv("TRAINWARDEN_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.delenv("TRAINWARDEN_AGENT_TOKEN", raising=False)
    app = create_app(SupervisorSettings(data_dir=tmp_path))
    with serve_in_thread(app) as sup:
        capsys.readouterr()
        assert cli.main(["token", "create", "job-1234", "--role", "agent", "--scope",
                         "team-a-1234", "--quiet", "--supervisor", sup]) == 0
        secret = capsys.readouterr().out.strip()
        assert secret.startswith("twt_") and "\n" not in secret
        job = {"Authorization": f"Bearer {secret}"}
        with httpx.Client(base_url=sup + "/api/v1", timeout=10) as c:
            body = {"node": "n0", "command": ["python", "train.py"]}
            assert c.post("/agents/register", headers=job,
                          json={"run": "team-a-1234", **body}).status_code == 200
            assert c.post("/agents/register", headers=job,
                          json={"run": "team-b-1", **body}).status_code == 403
            assert cli.main(["token", "revoke", "job-1234", "--supervisor", sup]) == 0
            # (stored tokens are cached for a few seconds; a fresh process would refuse now)
            app.state.stored_tokens.forget()
            assert c.post("/agents/register", headers=job,
                          json={"run": "team-a-1234", **body}).status_code == 401

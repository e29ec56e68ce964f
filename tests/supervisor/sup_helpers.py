"""Helpers shared by the supervisor tests (imported by name: tests/supervisor is on sys.path)."""

from __future__ import annotations

import json
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Connection, func, select

from trainwarden.supervisor.config import SupervisorSettings
from trainwarden.supervisor.store import tables
from trainwarden.supervisor.store._sql import with_specials
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.models import metadata

AGENT_TOKEN = "agent-secret"
OPERATOR_TOKEN = "operator-secret"
ADMIN_TOKEN = "admin-secret"  # (given to make_settings(admin_token=...) where a test needs it)
AGENT = {"Authorization": f"Bearer {AGENT_TOKEN}"}
OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


class FakeClock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def schema_url(base: str, schema: str) -> str:
    sep = "&" if "?" in base else "?"
    return f"{base}{sep}options=-csearch_path%3D{schema}"


def make_settings(**kw: Any) -> SupervisorSettings:
    base: dict[str, Any] = {"agent_token": AGENT_TOKEN, "operator_token": OPERATOR_TOKEN,
                            "restart_budget": 3, "restart_backoff_s": 1.0,
                            "restart_backoff_max_s": 4.0, "max_body_bytes": 64 * 1024}
    base.update(kw)
    return SupervisorSettings(**base)


CREDENTIAL_HEADER = "X-Trainwarden-Agent-Credential"


def credentials_of(client: TestClient) -> dict[int, str]:
    """The credentials ``register`` got through this client, by agent id."""
    creds: dict[int, str] = client.__dict__.setdefault("_tw_credentials", {})
    return creds


def as_agent(client: TestClient, agent_id: int) -> dict[str, str]:
    """The headers of agent ``agent_id``: the agent token and its credential."""
    cred = credentials_of(client).get(agent_id)
    return {**AGENT, **({CREDENTIAL_HEADER: cred} if cred else {})}


def register(client: TestClient, run: str = "r1", node: str = "n0",
             headers: dict[str, str] | None = None, roots: list[str] | None = None,
             nnodes: int = 2, spare: bool = False, min_nodes: int | None = None,
             expect: int = 200, scheduler_job: str = "") -> dict[str, Any]:
    """Register (again: presenting the credential it got before for this run and node); its
    checkpoints are saved under ``/ck`` unless ``roots`` says.  Its torchrun command declares
    ``nnodes`` nodes (a run admits that many); ``min_nodes``: the agent's --min-nodes."""
    mine = client.__dict__.setdefault("_tw_nodes", {})
    h = dict(headers if headers is not None else AGENT)
    if headers is None and (run, node) in mine:
        h.update(as_agent(client, mine[(run, node)]))
    r = client.post("/api/v1/agents/register", headers=h,
                    json={"run": run, "node": node, "hostname": f"host-{node}", "pid": 1,
                          "command": ["torchrun", f"--nnodes={nnodes}", "train.py"],
                          "nproc_per_node": 2, "spare": spare,
                          "checkpoint_roots": ["/ck"] if roots is None else roots,
                          **({} if min_nodes is None else {"min_nodes": min_nodes}),
                          **({"scheduler_job": scheduler_job} if scheduler_job else {})})
    assert r.status_code == expect, r.text
    if expect != 200:
        return dict(r.json())
    out: dict[str, Any] = r.json()
    if out.get("credential"):
        credentials_of(client)[out["agent_id"]] = out["credential"]
        mine[(run, node)] = out["agent_id"]
    return out


def ingest(client: TestClient, agent_id: int, seq: int, items: list[dict[str, Any]],
           attempt: int = 0, expect: int = 200) -> dict[str, Any]:
    # json.dumps, not httpx's json=: the wire carries NaN tokens, which httpx refuses.
    # Stamped when sent, as the agent does (the supervisor judges its own lateness by it).
    sent_at = client.app.state.clock()  # type: ignore[attr-defined]
    body = json.dumps({"agent_id": agent_id, "seq": seq, "sent_at": sent_at,
                       "attempt": attempt, "items": items})
    r = client.post("/api/v1/ingest", content=body,
                    headers={**as_agent(client, agent_id), "content-type": "application/json"})
    assert r.status_code == expect, r.text
    out: dict[str, Any] = r.json()
    return out


def step(rank: int, step_: int, attempt: int = 0, **kw: Any) -> dict[str, Any]:
    d = {"type": "step", "attempt": attempt, "rank": rank, "local_rank": rank % 2,
         "world_size": 4, "step": step_, "t": 100.0 + step_, "loss": 2.0 + rank,
         "samples": 8, "tokens": 1024, "data_s": 0.01, "compute_s": 0.2, "step_s": 0.25,
         "grad_norm": 1.0, "batch_index": step_}
    d.update(kw)
    return d


def crash(attempt: int = 0, rank: int = 0, code: int = 1) -> dict[str, Any]:
    return {"type": "exit", "attempt": attempt, "t": 200.0, "exit_code": code, "signal": None,
            "outcome": "crashed",
            "failed_ranks": [{"rank": rank, "local_rank": rank % 2, "exit_code": code,
                              "signal": None, "pid": 10, "message": "boom"}]}


def run_with_checkpoints(client: TestClient) -> int:
    """Run r1 on one agent (two ranks): steps 0-129 and complete checkpoints at steps 50, 100
    and 125 (/ck/step_N); returns the agent id (its next seq is 1)."""
    a = register(client, node="n0", nnodes=1)["agent_id"]
    items: list[dict[str, Any]] = [step(r, s, world_size=2) for s in range(0, 130)
                                   for r in (0, 1)]
    for s in (50, 100, 125):
        items.append({"type": "checkpoint", "step": s, "path": f"/ck/step_{s}", "bytes": 5,
                      "t": 100.0 + s, "lineage": "a0", "save_s": 0.1})
    ingest(client, a, 0, items)
    return int(a)


# ---- reading the store's tables directly (what no supervisor code needs to read) ----


def store_snapshot(db: Database) -> dict[str, list[str]]:
    """Every row of every table, as text (NaN != NaN would fail an equal store): for "nothing
    was stored" checks."""
    with db.read() as c:
        return {t.name: sorted(repr(tuple(r)) for r in c.execute(select(t)))
                for t in metadata.sorted_tables}


def count_rows(conn: Connection, table: str) -> int:
    """Row count of one table."""
    t = tables.__dict__[table]
    return int(conn.execute(select(func.count()).select_from(t)).scalar_one())


def stored_rank_steps(conn: Connection, run_id: int) -> list[dict[str, Any]]:
    """The stored per-rank step rows of a run, with their NaN/Inf put back."""
    q = select(tables.rank_steps).where(tables.rank_steps.c.run_id == run_id).order_by(
        tables.rank_steps.c.id)
    return [with_specials(dict(r._mapping)) for r in conn.execute(q)]


def command_rows(conn: Connection, run_id: int) -> list[dict[str, Any]]:
    q = select(tables.commands).where(tables.commands.c.run_id == run_id).order_by(
        tables.commands.c.id)
    return [dict(r._mapping) for r in conn.execute(q)]

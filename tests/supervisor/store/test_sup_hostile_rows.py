"""Pages, API reads, /metrics and the CLI's tables render anything the store holds.

Hostile rows go straight into the store (no API in between, as an older version, a bug or a
hand-edited database could leave them): huge, negative and non-finite times, wrong types in
every JSON column, HTML and terminal control characters in every text, very long strings,
out-of-range integers.  Every page and read endpoint answers 200 with the text escaped, the
JSON is strict JSON, /metrics parses, and every CLI table exits 0 with no control character
reaching the terminal."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text as sql_text

from tests.supervisor.sup_helpers import ADMIN, ADMIN_TOKEN, OPERATOR, OPERATOR_TOKEN, make_settings
from trainwarden.supervisor.cli import client as cli_client
from trainwarden.supervisor.cli import main as cli
from trainwarden.supervisor.cli.tables import printable
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store import tables
from trainwarden.supervisor.store.db import Database

SCRIPT = "<script>alert(1)</script>"
IMG = "<img src=x onerror=alert(1)>"  # (a run name has no "/": it is a path segment)
CONTROL = "\x1b]0;pwned\x07\x1b[2J\x9b31m\x08\n\u202e"
EVIL = SCRIPT + CONTROL + "'\"&"
LONG = "L" * 20_000
INF = math.inf
# Each run's times: one hostile value everywhere a time is stored.
TIMES = [INF, -INF, 1e300, -1e15, -1e300, 0.0, 5e-324]
RAW = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

# Wrong types in the JSON columns, one per run (cycled).
JSON_GARBAGE: list[Any] = [
    "a string", 42, None, [1, "two", None, {"x": [SCRIPT]}], {"nested": {"deep": [EVIL]}},
    True, [], {},
]
GPUS: list[Any] = [
    {"available": "yes", "reason": EVIL, "devices": [
        {"index": "zero", "name": EVIL, "temperature_c": "hot", "memory_used_bytes": "lots",
         "memory_total_bytes": -1, "utilization_percent": "1e999", "ecc_errors": [1],
         "power_w": {"w": 1}, "throttle": EVIL, "ecc_uncorrected": 3, "xid_errors": "many",
         "xid_last": [79]}]},
    {"available": True, "devices": "not a list"},
    {"available": True, "devices": [1, "x", None, {"index": 1e300, "temperature_c": 1e308}]},
    ["a", "list"],
    "gpus",
    {"devices": [{"memory_used_bytes": 5, "memory_total_bytes": 0}]},
]
WORKERS: list[Any] = [
    [{"rank": "r0", "pid": "p", "cpu_percent": "high", "rss_bytes": "big"}],
    [1, None, "w", {"rank": 1e300, "cpu_percent": 1e308, "rss_bytes": -5}],
    "workers",
    {"rank": 0},
]


def _host(i: int) -> str:
    """A node of the health ledger, one a run: every control character but the newline,
    which no path can carry (a route's path parameter stops at it)."""
    return f"host{i}{SCRIPT}{CONTROL.replace(chr(10), '')}"[:200]


def _status(i: int) -> str:
    return ["running", "restarting", "failed", "completed", "stopped", EVIL[:20]][i % 6]


def store_hostile(db: Database, postgres: bool) -> list[str]:
    """One run per hostile time value (plus one with a name only a store could hold);
    returns the run names."""
    text = EVIL if postgres else EVIL + "\x00nul"
    names = []
    big_int = 2**31 - 1 if postgres else 2**63 - 1
    times = [*TIMES, math.nan] if postgres else TIMES  # (SQLite stores NaN as NULL)
    with db.write() as conn:
        for i, t in enumerate(times):
            name = f"evil{i}{IMG}{CONTROL}"[:200]
            names.append(name)
            garbage = JSON_GARBAGE[i % len(JSON_GARBAGE)]
            jt = t if not postgres or math.isfinite(t) else str(t)  # Postgres JSON: finite
            run_id = conn.execute(tables.runs.insert().values(
                name=name, status=_status(i), attempt=i % 3, restarts=i, reason=text + LONG,
                protected=garbage if i % 2 else ["/ck/" + text, 7, None],
                created_at=t, updated_at=t).returning(tables.runs.c.id)).scalar_one()
            agent_id = conn.execute(tables.agents.insert().values(
                run_id=run_id, node=(text + "node")[:200], hostname=text[:255], pid=-1,
                command=garbage, nproc_per_node=-3, checkpoint_root=text,
                agent_version=text[:50], registered_at=t, last_seen_at=t, attempt=i,
                state=text[:20], disk_free_bytes=big_int if i % 2 else -5,
                disk_total_bytes=0 if i % 2 else 1, workers=WORKERS[i % len(WORKERS)],
                gpus=GPUS[i % len(GPUS)], dropped=big_int if postgres else -1,
            ).returning(tables.agents.c.id)).scalar_one()
            for step in (-5, 0, 1, big_int if i % 2 else 2):
                for attempt in sorted({i % 3, 0}):
                    conn.execute(tables.step_aggregates.insert().values(
                        run_id=run_id, attempt=attempt, step=step, ranks=-1 if step else 0,
                        loss_sum=t, loss_count=0 if step == 1 else 3, loss_min=-t,
                        loss_max=t, loss_nonfinite=-2, grad_norm_nonfinite=big_int,
                        samples=-7 if step else big_int, tokens=big_int, step_s_max=t,
                        t_first=t, t_last=-t if step == 1 else t))
                    for rank in (0, 1, big_int):
                        conn.execute(tables.rank_steps.insert().values(
                            run_id=run_id, attempt=attempt, step=step, rank=rank, t=t,
                            batch_index=-1, data_s=t, compute_s=-t, step_s=t, loss=t,
                            loss_special=text[:4], grad_norm=-t, grad_norm_special="inf",
                            lr=t))
            for rank in (0, 1, -1):
                conn.execute(tables.ranks.insert().values(
                    run_id=run_id, rank=rank, agent_id=agent_id, local_rank=-1, pid=big_int,
                    attempt=i % 3, step=big_int if rank else -5, t=t, data_s=t, compute_s=-t,
                    step_s=t, loss=t, loss_special="nan" if rank else text[:4], grad_norm=t,
                    grad_norm_special=None))
            for k, step in enumerate((1, 99, -3, big_int)):
                conn.execute(tables.checkpoints.insert().values(
                    run_id=run_id, agent_id=agent_id, attempt=i % 3, step=step,
                    path=f"/ck/{text}{LONG if k == 0 else ''}/step_{step}",
                    bytes=-1 if k else big_int, lineage=text[:200], complete=k != 2,
                    save_s=t, async_save=bool(k % 2), t=t, abandoned=k == 3))
            conn.execute(tables.events.insert(), [
                {"run_id": run_id, "agent_id": agent_id, "attempt": i % 3, "rank": r, "t": t,
                 "name": name_[:100], "step": step, "message": text + LONG,
                 "details": JSON_GARBAGE[(i + r) % len(JSON_GARBAGE)]}
                for r, (name_, step) in enumerate([
                    ("loss_spike_transient", -1), ("flops_declared", big_int),
                    ("stacks", None), (text, 5), ("clock_skew", 0),
                    ("batch_dead_lettered", 3)])])
            conn.execute(tables.exits.insert().values(
                run_id=run_id, agent_id=agent_id, attempt=i % 3, t=t, exit_code=-big_int,
                signal=big_int, outcome=text[:20], failed_ranks=garbage, handled=True,
                verdict=text[:20]))
            inc_id = conn.execute(tables.incidents.insert().values(
                run_id=run_id, kind=["loss_spike", "nonfinite_loss", "crash", text[:30]][i % 4],
                status=["open", "resolved", text[:20]][i % 3], step=-1 if i % 2 else big_int,
                attempt=i % 3, cause=text + LONG, agent_id=agent_id, node=text[:200],
                rank=-1, exit_code=big_int, signal=-1,
                details=(garbage if i % 3 else {"stacks": garbage, "start_step": "x",
                                                 "end_step": [1], "step": 1e300}),
                opened_at=t, updated_at=t, resolved_at=-t,
            ).returning(tables.incidents.c.id)).scalar_one()
            action_id = conn.execute(tables.actions.insert().values(
                run_id=run_id, incident_id=inc_id, kind=["restart", "stop", text[:20]][i % 3],
                reason=text + LONG, cause=text[:20], high_step=big_int,
                rollback_to_step=-1, actor=text[:100], status=["queued", text[:20]][i % 2],
                attempt=i % 3, plan=garbage if i % 2 else {"checkpoint": 5, "step": "x",
                                                           "checkpoint_step": [1]},
                not_before=t, resumed_step=-1 if i % 2 else None, created_at=t, updated_at=t,
                progress=garbage if i % 2 else {"queued": "soon", EVIL: jt},
            ).returning(tables.actions.c.id)).scalar_one()
            conn.execute(tables.commands.insert().values(
                run_id=run_id, agent_id=agent_id, action_id=action_id, kind=text[:20],
                attempt=i % 3, plan=garbage, collect_stacks=True, not_before=t,
                reason=text + LONG, status=text[:20], sent_count=-1, detail=text,
                created_at=t, updated_at=t))
            # the health ledger: this run's host, and evidence against its agent's node
            host = _host(i)
            conn.execute(tables.hosts.insert().values(
                node=host, state=["healthy", "cordoned", "probation", text[:20]][i % 4],
                reason=text + LONG, actor=text[:100], since=t, updated_at=t, cleared_at=-t,
                gpu_counters=garbage if i % 2 else {"ecc": garbage, "xid": {"0": "x"}}))
            if i == 0:  # the agents' node: counters last seen of every wrong shape
                conn.execute(tables.hosts.insert().values(
                    node=(text + "node")[:200], state="probation", reason="", actor="",
                    since=t, updated_at=t, gpu_counters={"ecc": [1], "xid": "x"}))
            for k, node in enumerate((host, (text + "node")[:200])):
                conn.execute(tables.host_evidence.insert().values(
                    node=node, kind=["ecc", "infra_failure", text[:30]][(i + k) % 3],
                    run_id=run_id, attempt=-1, t=t, detail=garbage, source=(f"{i}" + text)[:200]))
                conn.execute(tables.host_actions.insert().values(
                    node=node, kind=["cordon", text[:20]][k], actor=text[:100],
                    reason=text + LONG, run_id=run_id, evidence_ids=garbage, created_at=t))
        if not postgres:  # SQLite keeps any text in a JSON column, JSON or not
            conn.execute(sql_text(
                "UPDATE agents SET gpus = 'not json {', workers = '[1,' WHERE id % 2 = 0"))
            conn.execute(sql_text("UPDATE events SET details = '{\"a\":' WHERE id % 3 = 0"))
            conn.execute(sql_text("UPDATE actions SET plan = 'x', progress = '{' "))
            conn.execute(sql_text("UPDATE host_evidence SET detail = '[' WHERE id % 2 = 0"))
            conn.execute(sql_text("UPDATE host_actions SET evidence_ids = '{' "))
    return names




@pytest.fixture
def app(db: Database, clock: Any) -> FastAPI:
    return create_app(make_settings(admin_token=ADMIN_TOKEN), db=db, clock=clock,
                      upgrade_schema=False, start_evaluator=False)


@pytest.fixture
def hostile(app: FastAPI, db: Database) -> Iterator[tuple[TestClient, list[str]]]:
    names = store_hostile(db, postgres=not db.is_sqlite)
    # Server errors come back as 500s (not raised): the test lists every failure.
    with TestClient(app, raise_server_exceptions=False) as c:
        yield c, names


def _get_paths(app: FastAPI) -> list[str]:
    """Every GET route of the API (from the OpenAPI document) and of the dashboard."""
    from trainwarden.supervisor.dashboard.routes import router

    paths = [p for p, ops in app.openapi()["paths"].items() if "get" in ops]
    paths += [r.path for r in router.routes  # type: ignore[attr-defined]
              if "GET" in getattr(r, "methods", ())]
    return sorted(set(paths) - {"/docs", "/login"})


def _fill(path: str, run: str, action_id: int) -> str:
    host = _host(action_id - 1)  # (store_hostile's, one a run)
    return (path.replace("{run}", quote(run, safe=""))
            .replace("{action_id}", str(action_id)).replace("{node}", quote(host, safe="")))


def test_every_page_and_read_endpoint_renders_hostile_rows(
        hostile: tuple[TestClient, list[str]], app: FastAPI) -> None:
    c, names = hostile
    paths = _get_paths(app)
    assert "/" in paths and "/runs/{run}" in paths and "/api/v1/runs/{run}" in paths
    failures = []
    for action_id, run in enumerate(names, start=1):
        for path in paths:
            url = _fill(path, run, action_id)
            r = c.get(url, headers=ADMIN)
            if r.status_code != 200:
                failures.append(f"{r.status_code} {path} ({run!r}): {r.text[:300]}")
                continue
            kind = r.headers.get("content-type", "")
            if kind.startswith("text/html"):
                if SCRIPT in r.text or IMG in r.text:
                    failures.append(f"unescaped HTML in {path}")
            elif kind.startswith("application/json"):
                try:
                    json.loads(r.text, parse_constant=lambda s: (_ for _ in ()).throw(
                        ValueError(f"{s} is not JSON")))
                except ValueError as e:
                    failures.append(f"{path}: not strict JSON: {e}")
    assert failures == []


def test_metrics_renders_hostile_rows(hostile: tuple[TestClient, list[str]]) -> None:
    c, _names = hostile
    r = c.get("/metrics", headers=OPERATOR)
    assert r.status_code == 200, r.text[:2000]
    families = list(text_string_to_metric_families(r.text))
    assert any(f.name.startswith("trainwarden_") for f in families)


@pytest.mark.parametrize("cmd", ["runs", "incidents", "checkpoints", "actions", "plan",
                                 "hosts"])
def test_every_cli_table_prints_hostile_rows(
        hostile: tuple[TestClient, list[str]], app: FastAPI, cmd: str,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    _c, names = hostile

    def connect(_url: str, token: str | None) -> TestClient:
        return TestClient(app, base_url="http://testserver/api/v1",
                          raise_server_exceptions=False,
                          headers={"Authorization": f"Bearer {token}"})

    monkeypatch.setattr(cli_client, "connect", connect)
    for run in names[:1] if cmd in ("runs", "hosts") else names:
        argv = {"runs": ["runs"], "hosts": ["hosts"],
                "plan": ["plan", "--params", "125M", "--seq-len", "512", "--check", run],
                }.get(cmd, [cmd, run])
        assert cli.main([*argv, "--token", OPERATOR_TOKEN]) == 0, printable(run)
        out = capsys.readouterr().out
        assert RAW.findall(out) == [], f"a control character reached the terminal ({cmd})"
        assert len(out.splitlines()) >= 3


def test_the_health_ledger_reads_hostile_rows(hostile: tuple[TestClient, list[str]],
                                              app: FastAPI, db: Database) -> None:
    """Incidents, GPU readings, events and the counters kept, all hostile: the ledger's share
    of a tick reads them without failing (a failure would be retried on every tick)."""
    ledger = app.state.evaluator.ledger
    with db.write() as conn:
        done = ledger.tick(conn, 1_000_000.0)
    ledger.advance(done)
    with db.write() as conn:
        ledger.tick(conn, 1_000_010.0)

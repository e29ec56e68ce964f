"""A run's restart count is one number wherever it is shown: the runs API, the CLI's
``runs`` table, the dashboard's runs list and run page, and ``/metrics``.  The scripted run
is rolled back twice by an operator (a rollback restarts the workers: it counts), each new
attempt reaching its first step."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard.apps import FakeClock
from tests.dashboard.synth import OPERATOR, OPERATOR_TOKEN, SynthRun
from trainwarden.supervisor.cli import client as cli_client
from trainwarden.supervisor.cli import main as cli
from trainwarden.supervisor.control.evaluator import Evaluator

BY_CAUSE = {"crash": 0, "hang": 0, "node_lost": 0, "spike": 0, "sdc": 0, "operator": 2,
            "replace": 0, "grow": 0}


def rolled_back_twice(client: TestClient, clock: FakeClock, evaluator: Evaluator) -> SynthRun:
    """Run "twice": steps 0-29 (checkpoints 10, 20), an operator rollback to step 20, steps
    20-39 as attempt 1 (checkpoint 30), a rollback to step 30, steps 30-44 as attempt 2."""
    t0 = clock.now
    run = SynthRun(client, "twice").register()
    run.train(range(30), t0=t0, dt=2.0, checkpoint_every=10, clock=clock)
    evaluator.tick()
    for attempt, (to, steps) in enumerate([(20, range(20, 40)), (30, range(30, 45))], 1):
        clock.advance(2.0)
        r = client.post("/api/v1/runs/twice/rollback", headers=OPERATOR,
                        json={"step": to, "reason": f"rollback {attempt}"})
        assert r.status_code == 202, r.text
        evaluator.tick()
        for node in range(run.nodes):
            run.stopped(node, attempt - 1, t=clock.now + 1.0)
        clock.advance(3.0)
        run.restart_milestones(attempt=attempt, t_launch=clock.now, t_rendezvous=clock.now + 1,
                               t_preflight=clock.now + 1.5,
                               t_resumed=clock.now + 2, resume_step=to)
        run.train(steps, t0=clock.now + 3 - to * 2.0, dt=2.0, attempt=attempt,
                  checkpoint_every=10, clock=clock)
        evaluator.tick()
    clock.advance(5.0)
    evaluator.tick()
    return run


@pytest.fixture
def twice(client: TestClient, clock: FakeClock, evaluator: Evaluator) -> Iterator[SynthRun]:
    yield rolled_back_twice(client, clock, evaluator)


def test_two_operator_rollbacks_count_as_two_restarts_everywhere(
        twice: SynthRun, client: TestClient, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    # the API: the list and the run
    (summary,) = client.get("/api/v1/runs", headers=OPERATOR).json()["runs"]
    assert summary["attempt"] == 2
    assert summary["restarts"] == 2
    assert summary["restarts_by_cause"] == BY_CAUSE
    run = client.get("/api/v1/runs/twice", headers=OPERATOR).json()
    assert (run["restarts"], run["restarts_by_cause"]) == (2, BY_CAUSE)
    adv = run["checkpoint_interval"]["measured"]
    assert (adv["restarts"], adv["restarts_timed"]) == (2, 2)

    # the CLI's runs table, against the same app
    monkeypatch.setattr(cli_client, "connect", lambda url, token: TestClient(
        client.app, base_url="http://testserver/api/v1",
        headers={"Authorization": f"Bearer {token}"}))
    assert cli.main(["runs", "--supervisor", "http://testserver",
                     "--token", OPERATOR_TOKEN]) == 0
    head, _, row = capsys.readouterr().out.splitlines()[:3]
    assert row.split()[head.split().index("RESTARTS")] == "2"

    # the dashboard's runs list and run page
    html = client.get("/", headers=OPERATOR).text
    cell = re.search(r'<td class="n" data-col="restarts"[^>]*>(.*?)</td>', html, re.S)
    assert cell is not None and cell.group(1).strip() == "2"
    html = client.get("/runs/twice", headers=OPERATOR).text
    dd = re.search(r'<dd id="run-restarts">(.*?)</dd>', html, re.S)
    assert dd is not None
    assert re.sub(r"<[^>]+>", "", dd.group(1)).split() == ["2", "(operator", "2)"]
    restart_cost = re.search(r'<dd id="interval-restart">(.*?)</dd>', html, re.S)
    assert restart_cost is not None and "over 2 restarts" in restart_cost.group(1)

    # /metrics: every restart by cause, summing to the same count
    text = client.get("/metrics", headers=OPERATOR).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    by_cause = {s.labels["cause"]: s.value for s in fams["trainwarden_run_restarts"].samples
                if s.labels["run"] == "twice" and s.name.endswith("_total")}
    assert by_cause == BY_CAUSE
    assert sum(by_cause.values()) == 2

"""One statistic per question: on the same data, what the supervisor acts on (a detector's
finding, a policy decision) is the number ``/metrics`` exports, the API and the dashboard show,
and what the alert rules compare (run by the real ``promtool`` on the scraped values).

Each test feeds a run through the real ingest API, lets the evaluator decide, scrapes
``/metrics`` and turns the scrape into promtool input series held for 15 minutes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.dashboard.apps import T0, FakeClock, build_app
from tests.dashboard.synth import OPERATOR, SynthRun, step_item
from tests.deploy.test_alert_rules import ALERTS, _alert_blocks, _key_value, _run_promtool
from tests.metrics.test_metrics_export import Sample, scrape, series, value
from trainwarden.supervisor.control.evaluator import Evaluator

# The series the alert rules read, as the supervisor exports them.
ALERT_INPUTS = (
    "trainwarden_run_active", "trainwarden_run_info", "trainwarden_run_open_incidents",
    "trainwarden_rank_straggler_score", "trainwarden_rank_straggler_slow",
    "trainwarden_run_straggler_threshold", "trainwarden_run_restarts_without_progress",
    "trainwarden_run_restarts_without_progress_limit",
    "trainwarden_run_restart_budget_remaining",
)


def runbook(alert: str) -> str:
    return _key_value(_alert_blocks(ALERTS.read_text())[alert], "runbook")


def promtool_agrees(tmp_path: Path, samples: list[Sample], run: str,
                    expect: dict[str, list[dict[str, Any]]]) -> None:
    """The scraped values of ``run`` held constant for 15 minutes; at 14m each named alert
    fires exactly as ``expect`` says (``[]``: it does not fire)."""
    input_series = [
        {"series": name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
         + "}", "values": f"{v!r}x15"}
        for name, labels, v in samples if name in ALERT_INPUTS and labels.get("run") == run]
    doc = {"rule_files": [str(ALERTS)], "evaluation_interval": "1m",
           "tests": [{"interval": "1m", "input_series": input_series,
                      "alert_rule_test": [{"eval_time": "14m", "alertname": name,
                                           "exp_alerts": alerts}
                                          for name, alerts in expect.items()]}]}
    path = tmp_path / "agreement_test.yml"
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    _run_promtool("test", "rules", path)


# ---------------------------------------------------------------------------------------------
# the straggler score


def feed_two_ranks(run: SynthRun, clock: FakeClock, steps: range,
                   compute: tuple[float, float]) -> None:
    """Rank r (alone on node n<r>) spends ``compute[r]`` seconds before the collective; a
    step a second, each agent's batch delivered as its last step ends."""
    for start in range(steps.start, steps.stop, 10):
        clock.now = T0 + min(start + 10, steps.stop) - 1
        for node in (0, 1):
            items = []
            for s in range(start, min(start + 10, steps.stop)):
                item = step_item(node, s, t=T0 + s, world=2)
                item.update(data_s=0.0, compute_s=compute[node], step_s=max(compute))
                items.append(item)
            run.send(node, items)


@pytest.mark.parametrize(("case", "compute", "score", "slow"), [
    # two ranks, one 1.5x slower (against the median of all ranks it would score 0.833)
    ("slow", (0.2, 0.3), 2 / 3, True),
    ("mild", (0.2, 0.24), 0.2 / 0.24, False),
    # 1.5x as slow but only 1 ms slower: scheduler noise at millisecond steps, not a straggler
    ("tiny", (0.002, 0.003), 2 / 3, False),
])
def test_straggler_score_and_verdict_agree_everywhere(
        client: TestClient, clock: FakeClock, evaluator: Evaluator, tmp_path: Path,
        case: str, compute: tuple[float, float], score: float, slow: bool) -> None:
    run = SynthRun(client, case, nodes=2, ranks_per_node=1).register()
    feed_two_ranks(run, clock, range(30), compute)
    clock.now = T0 + 30.5
    evaluator.tick()

    # the detector
    incidents = client.get(f"/api/v1/runs/{case}/incidents", headers=OPERATOR).json()
    found = [i for i in incidents["incidents"] if i["kind"] == "straggler"]
    assert [(i["rank"], i["node"]) for i in found] == ([(1, "n1")] if slow else [])

    # /metrics
    samples = scrape(client)
    exported = value(samples, "trainwarden_rank_straggler_score", run=case, rank="1")
    assert exported == pytest.approx(score, rel=1e-9)
    assert value(samples, "trainwarden_rank_straggler_slow", run=case, rank="1") == int(slow)
    assert value(samples, "trainwarden_rank_straggler_slow", run=case, rank="0") == 0
    assert value(samples, "trainwarden_run_straggler_threshold", run=case) == 0.75
    if slow:
        assert found[0]["details"]["window_score"] == round(exported, 4)

    # the API
    ranks = client.get(f"/api/v1/runs/{case}/ranks", headers=OPERATOR).json()
    by_rank = {r["rank"]: r for r in ranks["ranks"]}
    assert by_rank[1]["score"] == exported and by_rank[1]["slow"] is slow
    assert by_rank[0]["slow"] is False
    assert ranks["straggler"]["threshold"] == 0.75

    # the dashboard: the ranks table (its slow mark) and the chart feed
    page = client.get(f"/runs/{case}", headers=OPERATOR)
    assert page.status_code == 200, page.text
    assert page.text.count('class="slow"') == int(slow)
    assert f"{exported:.2f}" in page.text
    chart = client.get(f"/dashboard/api/runs/{case}/series", headers=OPERATOR).json()["ranks"]
    shown = {s["rank"]: s for s in chart["series"]}
    assert shown[1]["score"] == exported and shown[1]["slow"] is slow

    # the alert, under promtool, on the scraped values
    fires = [{"exp_labels": {"severity": "warning", "run": case, "rank": "1", "node": "n1"},
              "exp_annotations": {
                  "summary": f"Rank 1 on node n1 is a straggler in run {case}",
                  "description": f"Rank 1 on node n1 of run {case} has a straggler score of "
                                 f"{exported:.2f} (peers' median time / its time; below the "
                                 "supervisor's threshold of 0.75) for 5 minutes: the whole "
                                 "synchronous run goes at its speed.",
                  "runbook": runbook("TrainwardenStraggler")}}]
    promtool_agrees(tmp_path, samples, case, {"TrainwardenStraggler": fires if slow else []})


# ---------------------------------------------------------------------------------------------
# the cause of a restart


def collective_timeout(run: SynthRun, attempt: int) -> None:
    run.send(0, [{"type": "event", "t": T0 + 40 + attempt, "attempt": attempt, "rank": 0,
                  "name": "collective_timeout",
                  "message": "RuntimeError: Timed out waiting 3000ms for recv operation",
                  "details": {"collective": "all_reduce (gradient sync in backward)"}}],
             attempt=attempt)


def test_a_collective_timeout_restart_has_one_cause_everywhere(
        client: TestClient, clock: FakeClock, evaluator: Evaluator, tmp_path: Path) -> None:
    """The policy counts a collective timeout against the hang budget; the action records that
    cause, ``/metrics`` counts the restart and the budget under it, the alert names it."""
    run = SynthRun(client, "ct").register()
    run.train(range(20), t0=T0)
    clock.now = T0 + 40.5
    collective_timeout(run, attempt=0)
    evaluator.tick()
    (inc,) = client.get("/api/v1/runs/ct/incidents", headers=OPERATOR).json()["incidents"]
    assert inc["kind"] == "collective_timeout"
    (act,) = client.get("/api/v1/runs/ct/actions", headers=OPERATOR).json()["actions"]
    assert act["cause"] == "hang"

    samples = scrape(client)
    assert value(samples, "trainwarden_run_restarts_total", run="ct", cause="hang") == 1
    assert not series(samples, "trainwarden_run_restarts_total", cause="collective_timeout")
    # the test app's restart budget is 3 per cause: the policy has 2 hang restarts left
    assert value(samples, "trainwarden_run_restart_budget_remaining", run="ct",
                 cause="hang") == 2
    assert value(samples, "trainwarden_run_restart_budget_remaining", run="ct",
                 cause="crash") == 3
    promtool_agrees(tmp_path, samples, "ct", {"TrainwardenRestartBudgetLow": [{
        "exp_labels": {"severity": "warning", "run": "ct", "cause": "hang"},
        "exp_annotations": {
            "summary": "Run ct has 2 automatic hang restarts left",
            "description": "Run ct has only 2 automatic restarts left in its hang budget; once "
                           "it is spent the next such failure stops the run.",
            "runbook": runbook("TrainwardenRestartBudgetLow")}}]})

    # Two more spend the hang budget; the fourth stops the run, and /metrics says 0 left.
    for attempt in (1, 2, 3):
        clock.advance(1)
        collective_timeout(run, attempt=attempt)
        evaluator.tick()
    r = client.get("/api/v1/runs/ct", headers=OPERATOR).json()
    assert r["status"] == "failed" and "restart (hang) budget of 3 spent" in r["reason"], r
    samples = scrape(client)
    assert value(samples, "trainwarden_run_restarts_total", run="ct", cause="hang") == 3
    assert value(samples, "trainwarden_run_restart_budget_remaining", run="ct",
                 cause="hang") == 0


# ---------------------------------------------------------------------------------------------
# restarts without progress


def test_restarts_without_progress_agree_with_the_stop(
        tmp_path: Path, clock: FakeClock) -> None:
    """A crash loop below step 29: ``/metrics`` counts the restarts the policy counts, the
    alert fires once the count reaches the policy's limit, and the next crash stops the run
    for no progress (paged as no progress, not twice as a failed run)."""
    from trainwarden.supervisor.store.db import make_database
    from trainwarden.supervisor.store.models import metadata

    db = make_database(f"sqlite:///{tmp_path / 'tw.db'}", pool_size=4)
    metadata.create_all(db.engine)
    app = build_app(db, clock, restart_budget=10)  # the crash budget is not what stops it
    try:
        with TestClient(app) as client:
            evaluator: Evaluator = app.state.evaluator
            run = SynthRun(client, "loop").register()
            run.train(range(30), t0=T0)
            counts = []
            for attempt in range(4):
                if attempt:
                    run.train(range(20, 25), t0=T0 + 10 * attempt, attempt=attempt)
                clock.now = T0 + 50 + attempt
                run.crash(attempt=attempt, t=clock.now)
                evaluator.tick()
                samples = scrape(client)
                counts.append(value(samples, "trainwarden_run_restarts_without_progress",
                                    run="loop"))
                if attempt == 1:
                    before_limit = samples
            assert counts == [1, 2, 3, 3]  # the fourth crash is not restarted
            assert value(samples, "trainwarden_run_restarts_without_progress_limit",
                         run="loop") == 3
            r = client.get("/api/v1/runs/loop", headers=OPERATOR).json()
            assert r["status"] == "failed", r
            assert "no progress: 3 restarts in a row without passing step 29" in r["reason"]
    finally:
        db.dispose()

    # Under promtool: 2 restarts without progress page nobody; at the limit (3) the run is
    # paged once, as no progress.
    promtool_agrees(tmp_path, before_limit, "loop", {"TrainwardenRunNoProgress": []})
    promtool_agrees(tmp_path, samples, "loop", {
        "TrainwardenRunNoProgress": [{
            "exp_labels": {"severity": "critical", "run": "loop"},
            "exp_annotations": {
                "summary": "Run loop makes no progress across restarts",
                "description": "Run loop restarted 3 times in a row without passing its "
                               "highest step, the supervisor's limit: the next failure stops "
                               "it (if it has not already); restarting it again will not "
                               "help.",
                "runbook": runbook("TrainwardenRunNoProgress")}}],
        "TrainwardenRunFailed": []})

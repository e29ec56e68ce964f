"""``GET /metrics``: the exposition parses, and carries the contract's series for a run fed
through the real ingest API."""

from __future__ import annotations

import math

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard.apps import T0, FakeClock, build_app
from tests.dashboard.synth import OPERATOR, SynthRun
from tests.deploy.test_alert_rules import CONTRACT
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.observability.metrics import (
    INCIDENT_KINDS,
    RESTART_CAUSES,
    STRAGGLER_TOP,
)
from trainwarden.supervisor.store.db import Database

Sample = tuple[str, dict[str, str], float]

RUN_GAUGES = [
    "trainwarden_run_info", "trainwarden_run_active", "trainwarden_run_step",
    "trainwarden_run_attempt", "trainwarden_run_loss",
    "trainwarden_run_throughput_samples_per_second", "trainwarden_run_seconds_since_last_step",
    "trainwarden_run_checkpoint_age_seconds", "trainwarden_run_restart_budget_remaining",
    "trainwarden_run_restarts_without_progress", "trainwarden_run_checkpoint_failed_saves",
]


def scrape(client: TestClient, headers: dict[str, str] | None = None) -> list[Sample]:
    r = client.get("/metrics", headers=OPERATOR if headers is None else headers)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return [(s.name, dict(s.labels), s.value)
            for fam in text_string_to_metric_families(r.text) for s in fam.samples]


def value(samples: list[Sample], name: str, **labels: str) -> float:
    found = [v for n, lab, v in samples if n == name and all(lab.get(k) == x
                                                            for k, x in labels.items())]
    assert len(found) == 1, (name, labels, found)
    return found[0]


def series(samples: list[Sample], name: str, **labels: str) -> list[dict[str, str]]:
    return [lab for n, lab, _ in samples
            if n == name and all(lab.get(k) == x for k, x in labels.items())]


def test_metrics_carry_the_contract_for_an_ingested_run(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = SynthRun(client, "alpha").register()
    run.declare_flops(flops_per_sample=1e9, peak_flops_per_rank=1e12)
    run.train(range(30), t0=T0, checkpoint_every=20, disk_free=7 * 2**30,
              disk_total=70 * 2**30, gpus={"available": True, "devices": [
                  {"index": 0, "util_percent": 90, "mem_used_bytes": 5, "temp_c": 70,
                   "ecc_uncorrected": 0}, {"index": 1, "util_percent": None}]})
    clock.now = T0 + 30
    evaluator.tick()  # accounts the run's goodput (a second after its newest step)
    clock.now = T0 + 40
    samples = scrape(client)
    for name in RUN_GAUGES:
        assert series(samples, name, run="alpha"), name
    assert value(samples, "trainwarden_run_info", run="alpha", status="running") == 1
    assert value(samples, "trainwarden_run_active", run="alpha") == 1
    assert value(samples, "trainwarden_run_step", run="alpha") == 29
    assert value(samples, "trainwarden_run_attempt", run="alpha") == 0
    assert 1.0 < value(samples, "trainwarden_run_loss", run="alpha") < 5.0
    # 4 ranks x 8 samples per step, one step a second
    assert math.isclose(value(samples, "trainwarden_run_throughput_samples_per_second",
                              run="alpha"), 32.0)
    assert value(samples, "trainwarden_run_seconds_since_last_step", run="alpha") == 11.0
    assert value(samples, "trainwarden_run_checkpoint_age_seconds", run="alpha") == 20.0
    # steps 0..29 trained, step_20 holds the first 20: a failure now redoes 10
    assert value(samples, "trainwarden_run_checkpoint_age_steps", run="alpha") == 10
    assert value(samples, "trainwarden_run_checkpoint_failed_saves", run="alpha") == 0
    for cause in ("crash", "hang", "node_lost", "spike"):
        assert value(samples, "trainwarden_run_restart_budget_remaining", run="alpha",
                     cause=cause) == 3
    assert value(samples, "trainwarden_run_restarts_without_progress", run="alpha") == 0
    # 32 samples a second x 1 GFLOP / (4 ranks x 1 TFLOP/s)
    assert math.isclose(value(samples, "trainwarden_run_mfu_ratio", run="alpha"), 0.008)
    for kind in INCIDENT_KINDS:
        assert value(samples, "trainwarden_run_open_incidents", run="alpha", kind=kind) == 0
    for cause in RESTART_CAUSES:
        assert value(samples, "trainwarden_run_restarts_total", run="alpha", cause=cause) == 0
    for node in ("n0", "n1"):
        assert value(samples, "trainwarden_agent_heartbeat_age_seconds",
                     run="alpha", node=node) == 40.0  # ingested at T0, scraped at T0 + 40
        assert value(samples, "trainwarden_agent_disk_free_bytes",
                     run="alpha", node=node) == 7 * 2**30
        assert value(samples, "trainwarden_agent_disk_free_ratio", run="alpha",
                     node=node) == 0.1
        assert value(samples, "trainwarden_agent_worker_cpu_percent", run="alpha",
                     node=node) == 198.0
        assert value(samples, "trainwarden_agent_worker_rss_bytes", run="alpha",
                     node=node) == 2 * 2**30
        assert value(samples, "trainwarden_agent_gpu_available", run="alpha", node=node) == 1
        assert value(samples, "trainwarden_gpu_utilization_percent", run="alpha", node=node,
                     gpu="0") == 90
        assert value(samples, "trainwarden_gpu_temperature_celsius", run="alpha", node=node,
                     gpu="0") == 70
        assert value(samples, "trainwarden_gpu_ecc_uncorrected_errors", run="alpha",
                     node=node, gpu="0") == 0
    # a reading the GPU does not support is left out, not exported as 0
    assert not series(samples, "trainwarden_gpu_utilization_percent", gpu="1")
    # the live goodput: steps of 0.25 s (less 0.02 s data wait) in 40 s of wall time; step 0
    # ends at the run's registration, so none of it falls in the run's wall time
    assert math.isclose(value(samples, "trainwarden_run_wall_seconds", run="alpha"), 40.0)
    assert math.isclose(value(samples, "trainwarden_run_goodput_ratio", run="alpha"),
                        29 * (0.25 - 0.02) / 40, rel_tol=1e-6)
    # the nodes the ledger read GPUs of: healthy
    for node in ("n0", "n1"):
        assert value(samples, "trainwarden_host_cordoned", node=node) == 0
        assert value(samples, "trainwarden_host_probation", node=node) == 0
    # everything the alert rules and the Grafana dashboard are written against is exported
    # (the fleet's series only by a supervisor with a fleet: tests/e2e/test_slurm_fleet.py)
    fleet_only = {n for n in CONTRACT if n.startswith("trainwarden_fleet_")}
    assert fleet_only
    assert {n for n, _, _ in samples} >= CONTRACT - fleet_only
    assert not {n for n, _, _ in samples} & fleet_only
    scores = series(samples, "trainwarden_rank_straggler_score", run="alpha")
    assert {(s["rank"], s["node"]) for s in scores} == {("0", "n0"), ("1", "n0"),
                                                         ("2", "n1"), ("3", "n1")}

    # A crash: one incident, one restart counted under its cause, the budget goes down.
    run.crash(node=1, rank=2, t=T0 + 41)
    clock.now = T0 + 42
    evaluator.tick()
    samples = scrape(client)
    assert value(samples, "trainwarden_run_info", run="alpha", status="restarting") == 1
    assert value(samples, "trainwarden_run_active", run="alpha") == 1
    assert value(samples, "trainwarden_run_attempt", run="alpha") == 1
    assert value(samples, "trainwarden_run_restarts_total", run="alpha", cause="crash") == 1
    assert value(samples, "trainwarden_run_restart_budget_remaining", run="alpha",
                 cause="crash") == 2
    assert value(samples, "trainwarden_run_restart_budget_remaining", run="alpha",
                 cause="spike") == 3
    assert value(samples, "trainwarden_run_open_incidents", run="alpha", kind="crash") == 1
    assert value(samples, "trainwarden_run_step", run="alpha") == 29  # attempt 1: none yet

    # The next attempt resumes below the old high and reports a NaN loss.
    run.train(range(20, 25), t0=T0 + 30, attempt=1, nan_at=24)
    samples = scrape(client)
    assert value(samples, "trainwarden_run_step", run="alpha") == 24
    assert math.isnan(value(samples, "trainwarden_run_loss", run="alpha"))

    # The policy's count: one automatic restart since which the run has not passed step 29
    # (the limit the policy stops the run at is exported beside it).
    assert value(samples, "trainwarden_run_restarts_without_progress", run="alpha") == 1
    assert value(samples, "trainwarden_run_restarts_without_progress_limit", run="alpha") == 3

    # An operator's restart: its own cause, outside the budgets and the no-progress count.
    r = client.post("/api/v1/runs/alpha/restart", headers=OPERATOR, json={"reason": "test"})
    assert r.status_code == 200, r.text
    samples = scrape(client)
    assert value(samples, "trainwarden_run_restarts_total", run="alpha", cause="operator") == 1
    assert value(samples, "trainwarden_run_restarts_total", run="alpha", cause="crash") == 1
    assert value(samples, "trainwarden_run_restarts_without_progress", run="alpha") == 1
    assert value(samples, "trainwarden_run_restart_budget_remaining", run="alpha",
                 cause="crash") == 2

    # Supervisor's own metrics: templated routes, ingest latency observed.
    routes = {lab["route"] for lab in series(samples, "trainwarden_http_requests_total")}
    assert {"/api/v1/ingest", "/api/v1/agents/register", "/metrics"} <= routes
    assert not any("alpha" in r for r in routes)
    assert value(samples, "trainwarden_ingest_latency_seconds_count") >= 9
    buckets = {lab["le"] for lab in series(samples, "trainwarden_ingest_latency_seconds_bucket")}
    assert buckets == {"0.005", "0.01", "0.025", "0.05", "0.1", "0.25", "0.5", "1.0", "2.5",
                       "+Inf"}


def test_every_node_of_the_ledger_says_whether_it_is_cordoned(client: TestClient) -> None:
    """Hosts serve every run: their series carry the node only, cordoned or not, whatever
    runs are there."""
    for node, why in (("n0", "fans"), ("n1", "ECC"), ("spare", "never registered")):
        r = client.post(f"/api/v1/hosts/{node}/cordon", headers=OPERATOR, json={"reason": why})
        assert r.status_code == 200, r.text
    r = client.post("/api/v1/hosts/n1/uncordon", headers=OPERATOR, json={"reason": "fixed"})
    assert r.status_code == 200, r.text
    samples = scrape(client)
    got = {lab["node"]: (v, value(samples, "trainwarden_host_probation", node=lab["node"]))
           for n, lab, v in samples if n == "trainwarden_host_cordoned"}
    assert got == {"n0": (1, 0), "n1": (0, 1), "spare": (1, 0)}
    assert set(series(samples, "trainwarden_host_cordoned")[0]) == {"node"}


def test_straggler_series_are_bounded_with_40_ranks(client: TestClient,
                                                   clock: FakeClock) -> None:
    run = SynthRun(client, "wide", nodes=5, ranks_per_node=8).register()
    run.train(range(30), t0=T0, slow_rank=27)
    samples = scrape(client)
    scores = {int(lab["rank"]): (lab["node"], v) for n, lab, v in samples
              if n == "trainwarden_rank_straggler_score"}
    assert len(scores) == STRAGGLER_TOP
    node, score = scores[27]
    assert node == "n3" and score < 0.75
    assert min(scores.items(), key=lambda kv: kv[1][1])[0] == 27


def test_straggler_scores_cover_every_rank_while_one_node_lags(client: TestClient) -> None:
    """Agents deliver through their own batches, so one node's newest steps can be far ahead
    of another's: throughput and the scores are judged on the steps every rank has delivered,
    and a slow rank on the node behind is still named."""
    run = SynthRun(client, "lagging").register()
    run.train(range(30), t0=T0, slow_rank=3)
    run.train(range(30, 60), t0=T0, slow_rank=3, nodes=range(1))  # node n1 has not sent these
    samples = scrape(client)
    scores = {int(lab["rank"]): v for n, lab, v in samples
              if n == "trainwarden_rank_straggler_score" and lab["run"] == "lagging"}
    # 4 ranks x 8 samples a step, a step a second: not half of it from node n0's steps alone
    assert math.isclose(value(samples, "trainwarden_run_throughput_samples_per_second",
                              run="lagging"), 32.0)
    assert value(samples, "trainwarden_run_step", run="lagging") == 59
    assert set(scores) == {0, 1, 2, 3}
    assert scores[3] < 0.75 and min(scores, key=lambda k: scores[k]) == 3
    page = client.get("/runs/lagging", headers=OPERATOR)
    assert page.status_code == 200, page.text
    assert page.text.count('class="slow"') == 1 and f"{scores[3]:.2f}" in page.text
    chart = client.get("/dashboard/api/runs/lagging/series", headers=OPERATOR).json()["ranks"]
    assert chart["series"][0]["rank"] == 3 and chart["series"][0]["score"] == scores[3]


def test_only_active_or_recent_runs_are_exported(db: Database, clock: FakeClock) -> None:
    app = build_app(db, clock)
    with TestClient(app) as client:
        SynthRun(client, "old").register().train(range(3), t0=T0)
        with db.write() as conn:
            from trainwarden.supervisor.store import registry
            r = registry.get_run_by_name(conn, name="old")
            assert r is not None
            registry.set_run_status(conn, run_id=r["id"], status="completed", now=clock())
        clock.advance(3600)
        samples = scrape(client)
        assert value(samples, "trainwarden_run_active", run="old") == 0
        assert value(samples, "trainwarden_run_info", run="old", status="completed") == 1
        clock.advance(24 * 3600)
        assert not series(scrape(client), "trainwarden_run_info", run="old")


def test_metrics_follow_the_read_rule(db: Database, clock: FakeClock) -> None:
    with TestClient(build_app(db, clock)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics", headers={"Authorization": "Bearer nope"}
                          ).status_code == 401
        scrape(client, {"Authorization": "Bearer agent-secret"})
    with TestClient(build_app(db, clock, public_reads=True)) as client:
        scrape(client, {})


def test_failed_saves_and_the_exposure_grow_until_a_save_completes(
        client: TestClient, clock: FakeClock) -> None:
    """A full checkpoint disk: each failed save counts, the steps and seconds since the last
    good checkpoint grow; the next complete checkpoint resets the count."""
    run = SynthRun(client, "full").register()
    run.train(range(21), t0=T0, checkpoint_every=20)
    for step in (30, 40):
        run.event(0, "checkpoint_failed", t=T0 + step, attempt=0, rank=0, step=step,
                  details={"reason": "disk_full", "errno": 28, "path": f"/ckpt/step_{step}"})
    run.train(range(21, 45), t0=T0)
    clock.now = T0 + 50
    samples = scrape(client)
    assert value(samples, "trainwarden_run_checkpoint_failed_saves", run="full") == 2
    assert value(samples, "trainwarden_run_checkpoint_age_steps", run="full") == 25
    assert value(samples, "trainwarden_run_checkpoint_age_seconds", run="full") == 30.0
    run.train(range(45, 51), t0=T0, checkpoint_every=50)  # room again: step_50 completes
    clock.now = T0 + 51
    samples = scrape(client)
    assert value(samples, "trainwarden_run_checkpoint_failed_saves", run="full") == 0
    assert value(samples, "trainwarden_run_checkpoint_age_steps", run="full") == 1

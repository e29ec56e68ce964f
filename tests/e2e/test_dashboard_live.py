"""The dashboard in a real browser during a real run: a loss spike injected into torchrun,
detected and rolled back by the supervisor, seen on the page; then an operator rolls back
through the page's form and follows the action to the resumed step."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard.browser import (
    browser_page,
    login,
    require_browser,
    rollback_via_form,
    screenshot,
    wait_for_charts,
    wait_for_rollback,
)
from tests.e2e.system import OPERATOR_TOKEN, Agent, Supervisor, ddp_script, wait_until

pytestmark = pytest.mark.e2e


def scrape(sup: Supervisor) -> dict[str, list[tuple[dict[str, str], float]]]:
    r = httpx.get(f"{sup.url}/metrics", timeout=10,
                  headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
    assert r.status_code == 200, r.text
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(r.text):
        for smp in fam.samples:
            out.setdefault(smp.name, []).append((dict(smp.labels), smp.value))
    return out


def one(m: dict[str, list[tuple[dict[str, str], float]]], name: str, **labels: str) -> float:
    found = [v for lab, v in m.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, m.get(name))
    return found[0]


def check_metrics_of_a_live_run(sup: Supervisor) -> None:
    """/metrics of the real run, parsed by prometheus-client: the series the alert rules and
    the Grafana dashboard read, with values that match what happened."""
    def trained_on() -> dict[str, list[tuple[dict[str, str], float]]] | None:
        # The resumed attempt has steps, a rate and a checkpoint again, and both ranks have
        # reported in it (each worker's reports reach the agent on their own).
        m = scrape(sup)
        return m if m.get("trainwarden_run_checkpoint_age_seconds") and m.get(
            "trainwarden_run_throughput_samples_per_second") and len(m.get(
                "trainwarden_rank_straggler_score", [])) == 2 else None

    m = wait_until(trained_on, 60, "metrics of the resumed attempt")
    assert one(m, "trainwarden_run_info", run="live", status="running") == 1
    assert one(m, "trainwarden_run_active", run="live") == 1
    assert one(m, "trainwarden_run_attempt", run="live") == 1
    assert one(m, "trainwarden_run_step", run="live") >= 250
    assert one(m, "trainwarden_run_loss", run="live") < 5.0  # back down after the rollback
    assert one(m, "trainwarden_run_throughput_samples_per_second", run="live") > 100
    assert 0 < one(m, "trainwarden_run_mfu_ratio", run="live") < 1
    assert one(m, "trainwarden_run_seconds_since_last_step", run="live") < 30
    assert one(m, "trainwarden_run_restarts_total", run="live", cause="spike") == 1
    assert one(m, "trainwarden_run_restart_budget_remaining", run="live", cause="spike") == 2
    assert one(m, "trainwarden_run_restart_budget_remaining", run="live", cause="crash") == 10
    assert one(m, "trainwarden_run_open_incidents", run="live", kind="loss_spike") == 0
    assert {lab["rank"] for lab, _ in m["trainwarden_rank_straggler_score"]} == {"0", "1"}
    assert one(m, "trainwarden_agent_heartbeat_age_seconds", run="live", node="node0") < 30
    assert one(m, "trainwarden_agent_disk_free_bytes", run="live", node="node0") > 0
    assert 0 < one(m, "trainwarden_agent_disk_free_ratio", run="live", node="node0") <= 1
    assert one(m, "trainwarden_agent_worker_cpu_percent", run="live", node="node0") > 0
    assert one(m, "trainwarden_agent_worker_rss_bytes", run="live", node="node0") > 100e6
    assert one(m, "trainwarden_agent_gpu_available", run="live", node="node0") == 0  # CPU box
    assert one(m, "trainwarden_ingest_latency_seconds_count") > 10
    # the live goodput: the rollback threw steps away and the restart took time
    assert 0 < one(m, "trainwarden_run_goodput_ratio", run="live") < 1
    assert one(m, "trainwarden_run_badput_seconds", run="live", cause="lost_progress") > 0
    assert one(m, "trainwarden_run_badput_seconds", run="live", cause="restart") > 0
    g = sup.get("/runs/live")["goodput"]
    assert sum(g["badput_s"].values()) + g["productive_s"] == pytest.approx(g["wall_s"],
                                                                             rel=1e-6)
    assert g["steps_lost"] > 0
    assert g["badput_s"]["idle"] == 0.0  # the agent ran all along


def test_spike_rollback_seen_and_operator_rollback_through_the_form(tmp_path: Path) -> None:
    require_browser()
    sup = Supervisor(tmp_path / "sup", env={"TRAINWARDEN_ROLLBACK_LR_STEPS": "30",
                                            "TRAINWARDEN_ROLLBACK_LR_RAMP_STEPS": "20",
                                            "TRAINWARDEN_RESTART_BACKOFF_S": "0.5"}).start()
    agent = Agent(sup.url, "live", "node0", tmp_path, [
        "--nproc_per_node=2", "--standalone", *ddp_script(
            "--hidden", "32", "--seed", "2", "--checkpoint-every-steps", "50",
            "--steps", "3000", "--step-sleep", "0.01", "--inject", "spike@300",
            "--peak-tflops", "0.05",
            "--checkpoint-dir", str(tmp_path / "ck"))])
    try:
        def auto_rollback() -> dict | None:
            acts = (sup.get_or_none("/runs/live/actions") or {}).get("actions", [])
            done = [a for a in acts if a["cause"] == "spike" and a["status"] == "resumed"]
            return done[0] if done else None

        auto = wait_until(auto_rollback, 180, "the automatic rollback past the spike")
        target = int(auto["resumed_step"])  # pinned by the agent: it stays on disk
        check_metrics_of_a_live_run(sup)
        with browser_page() as page:
            login(page, sup.url, OPERATOR_TOKEN, path="/runs/live")
            wait_for_charts(page)
            text = page.inner_text("body")
            assert "loss_spike" in text and "resumed" in text
            # MFU (the run declared its FLOPs and a peak), the nodes' health as measured here
            page.wait_for_selector("#chart-mfu canvas")
            assert page.inner_text("#mfu-value").endswith("%")
            nodes = page.inner_text("#nodes")
            assert "% CPU" in nodes and "not available (NVML" in nodes, nodes
            series = httpx.get(f"{sup.url}/dashboard/api/runs/live/series", timeout=10,
                               headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}).json()
            spikes = [m for m in series["markers"] if m["type"] == "spike"]
            assert spikes and spikes[0]["from"] == 300  # the spike is marked on the loss chart
            assert any(m["type"] == "restart" and m["from"] == target
                       for m in series["markers"])
            screenshot(page, "live-run-after-spike-rollback")
            rollback_via_form(page, checkpoint_step=target, operator_token=OPERATOR_TOKEN,
                              reason="from the dashboard", skip="600-649", lr_scale=0.5,
                              lr_scale_steps=20, lr_ramp_steps=10,
                              screenshot_name="live-rollback-dialog")
            progress = wait_for_rollback(page, "resumed", timeout_ms=120_000)
            assert f"{target}" in progress
            screenshot(page, "live-rollback-resumed")
        (mine,) = [a for a in sup.get("/runs/live/actions")["actions"]
                   if a["actor"] == "operator"]
        assert mine["reason"] == "from the dashboard" and mine["status"] == "resumed"
        assert mine["plan"]["skip"] == [[600, 649]]
        assert mine["plan"]["lr"] == {"scale": 0.5, "steps": 20, "ramp_steps": 10}
    finally:
        agent.stop()
        sup.stop()

"""The run page shows each restart's phases, the checkpoint-interval advice and the MFU
diagnosis, the same figures as the API; ``/metrics`` has the phases as
a histogram.  The scripted run is ``synth.efficiency_script``'s (phases 1.5, 1, 2.5, 2 and
2 s, 9 s in all)."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from tests.dashboard.apps import FakeClock
from tests.dashboard.synth import OPERATOR, SynthRun, efficiency_script
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.dashboard.routes import fmt_num, fmt_pct

PHASE_S = {"stop_workers": 1.5, "launch": 1.0, "rendezvous": 2.5, "preflight": 1.0,
           "load_checkpoint": 1.0,
           "first_step": 2.0}


def _dd(html: str, ident: str) -> str:
    m = re.search(rf'<dd id="{ident}"[^>]*>(.*?)</dd>', html, re.S)
    assert m is not None, ident
    return re.sub(r"<[^>]+>", "", m.group(1)).strip()


def test_run_page_shows_restart_phases_advice_and_mfu(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    efficiency_script(client, clock, evaluator)
    html = client.get("/runs/alpha", headers=OPERATOR).text
    for phase, secs in PHASE_S.items():
        assert f'<li data-phase="{phase}">{phase} {fmt_num(secs)}</li>' in html, phase
    assert '<span class="total" data-phase="total">total 9</span>' in html
    api = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()
    adv, m = api["checkpoint_interval"], api["mfu"]
    assert _dd(html, "interval-recommended") == f"{fmt_num(adv['recommended_s'])} s"
    assert _dd(html, "interval-current") == "20 s"
    assert _dd(html, "ettr-current") == fmt_pct(adv["ettr_current"])
    assert _dd(html, "ettr-recommended") == fmt_pct(adv["ettr_recommended"])
    assert _dd(html, "interval-failures") == "1 in 2 min on 2 nodes (MTBF 2 min, observed)"
    assert _dd(html, "interval-save").startswith("1.5 s")
    assert _dd(html, "interval-restart").startswith("11 s")
    assert 'id="interval-state"' not in html
    assert _dd(html, "mfu-run") == fmt_pct(m["mfu"])
    assert _dd(html, "mfu-band").startswith("host_bound:")
    assert _dd(html, "scaling-efficiency").startswith("50.0 %")
    assert _dd(html, "scaling-likely") == "straggler"
    rank3 = re.search(r'<tr data-rank="3">(.*?)</tr>', html, re.S)
    assert rank3 is not None
    cells = re.findall(r'<td class="n">(.*?)</td>', rank3.group(1))
    assert cells[2] == fmt_pct(0.3 / 0.7)  # its data share
    causes = re.findall(r'<li data-cause="(\w+)" class="v-(\w+)">', html)
    assert causes == [("data_loader", "against"), ("batch_per_device", "against"),
                      ("interconnect", "against"), ("straggler", "for")]


def test_unknown_phases_read_unknown_and_no_failure_reads_not_enough_data(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    efficiency_script(client, clock, evaluator, milestones=False)
    html = client.get("/runs/alpha", headers=OPERATOR).text
    assert ('<li data-phase="launch" class="muted" title="a milestone of this phase was not '
            'recorded">launch unknown</li>') in html
    calm = SynthRun(client, "calm").register()
    calm.train(range(30), t0=clock.now + 5, dt=2.0, checkpoint_every=10)
    clock.now += 80
    html = client.get("/runs/calm", headers=OPERATOR).text
    assert 'id="interval-state"' in html
    assert "Not enough data for a recommendation yet: failures: none observed" in html
    assert _dd(html, "interval-recommended") == "n/a"


def test_restart_phases_histogram_on_metrics(client: TestClient, clock: FakeClock,
                                             evaluator: Evaluator) -> None:
    efficiency_script(client, clock, evaluator)
    text = client.get("/metrics", headers=OPERATOR).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    samples = [s for s in fams["trainwarden_restart_phase_seconds"].samples
               if s.labels["run"] == "alpha"]
    sums = {s.labels["phase"]: s.value for s in samples if s.name.endswith("_sum")}
    assert sums == {**{k: pytest.approx(v) for k, v in PHASE_S.items()},
                    "total": pytest.approx(9.0)}
    counts = {s.labels["phase"]: s.value for s in samples if s.name.endswith("_count")}
    assert set(counts.values()) == {1.0}
    le = {s.labels["le"]: s.value for s in samples
          if s.name.endswith("_bucket") and s.labels["phase"] == "rendezvous"}
    assert (le["2.5"], le["1.0"]) == (1.0, 0.0)  # 2.5 s: in the 2.5 bucket, not below


def test_unknown_phases_are_left_out_of_the_histogram(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    efficiency_script(client, clock, evaluator, milestones=False)
    text = client.get("/metrics", headers=OPERATOR).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    phases = {s.labels["phase"] for s in fams["trainwarden_restart_phase_seconds"].samples
              if s.labels["run"] == "alpha"}
    assert phases == {"stop_workers", "total"}

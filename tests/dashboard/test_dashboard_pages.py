"""Server-rendered dashboard pages, conditional requests and the browser auth rules."""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from tests.dashboard.apps import T0, FakeClock, build_app
from tests.dashboard.synth import AGENT, OPERATOR, OPERATOR_TOKEN, SynthRun
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry
from trainwarden.supervisor.store.db import Database


def seed(client: TestClient, db: Database, clock: FakeClock, evaluator: Evaluator) -> SynthRun:
    """A run with a spike, checkpoints, a crash (incident + restart action) and a hang
    incident with stacks."""
    run = SynthRun(client, "alpha").register()
    run.train(range(60), t0=T0, spike=(30, 36), checkpoint_every=20, disk_free=9 * 2**30)
    run.crash(node=1, rank=3, t=T0 + 61)
    clock.now = T0 + 62
    evaluator.tick()
    with db.write() as conn:
        r = registry.get_run_by_name(conn, name="alpha")
        assert r is not None
        rec.open_incident(conn, run_id=r["id"], kind="hang", cause="no step progress for 45 s",
                           attempt=0, node="n0", rank=1, opened_at=T0 + 50,
                           details={"stacks": {"1": "File \"train.py\", line 9, in <module>\n"
                                                    "  dist.all_reduce(t)  # <stuck>",
                                               "0": "File \"train.py\", line 7"}})
        rec.open_incident(conn, run_id=r["id"], kind="loss_spike",
                           cause="loss 3.1x the baseline for 7 steps", attempt=0,
                           opened_at=T0 + 37, details={"start_step": 30, "step": 36})
        rec.insert_event(conn, run_id=r["id"], attempt=0, t=T0 + 20, step=12,
                          name="loss_spike_transient", message="transient loss spike",
                          details={"start_step": 12, "recovered_at_step": 15,
                                   "spike_cost": {"lost_steps": 3, "lost_s": 1.5,
                                                  "lost_steps_at_end": None,
                                                  "rollback_steps": 40.0, "rollback_s": 20.0,
                                                  "cheaper": "wait",
                                                  "restart_measured": True}})
    return run


def test_runs_list_and_run_page(client: TestClient, db: Database, clock: FakeClock,
                                evaluator: Evaluator) -> None:
    seed(client, db, clock, evaluator)
    page = client.get("/", headers=OPERATOR)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    assert 'href="/runs/alpha"' in html and "restarting" in html
    assert "crash 1" in html and "hang 1" in html and "loss_spike 1" in html
    assert "step 40" in html  # the newest checkpoint

    r = client.get("/runs/alpha", headers=OPERATOR)
    assert r.status_code == 200
    html = r.text
    # incidents, with the hang's stacks in a <details> block, rank order
    assert 'id="incidents"' in html and "worker on node n1 rank 3" in html
    assert "stacks of 2 ranks" in html and "dist.all_reduce(t)  # &lt;stuck&gt;" in html
    assert html.index("<h4>rank 0</h4>") < html.index("<h4>rank 1</h4>")
    # actions with progress and the plan
    assert 'id="actions"' in html and "gang restart after crash" in html
    assert "queued" in html and "&#34;attempt&#34;: 1" in html
    # checkpoints, each with a rollback form
    assert html.count('class="rollback"') == 2 and 'data-step="40"' in html
    # nodes: heartbeat age, free disk and its share, the workers' CPU and memory
    assert 'id="nodes"' in html and "9.0 GiB (9.0% of 100.0 GiB)" in html
    assert "198% CPU, 2.0 GiB" in html and "2 workers" in html
    assert "not reported" in html  # GPU health: this synthetic agent sends no reading
    assert 'id="mfu-value" class="muted"' in html and 'id="chart-mfu"' not in html
    # charts' containers and the vendored uPlot (no CDN)
    assert 'id="chart-loss"' in html and "/static/vendor/uplot/uPlot.iife.min.js" in html
    assert "https://" not in html.split("<main>")[0]
    assert client.get("/static/vendor/uplot/uPlot.iife.min.js").status_code == 200
    assert client.get("/runs/nope", headers=OPERATOR).status_code == 404

    tables = client.get("/runs/alpha/tables", headers=OPERATOR)
    assert tables.status_code == 200 and 'id="checkpoints"' in tables.text
    assert "<html" not in tables.text


def test_chart_feed_marks_spikes_and_restarts(client: TestClient, db: Database,
                                              clock: FakeClock, evaluator: Evaluator) -> None:
    run = seed(client, db, clock, evaluator)
    run.seq = {0: 100, 1: 100}
    # 22 steps: the detector skips an attempt's first 10 (a cold start) and judges a rank on
    # 10 or more (not on a handful), and the chart's scores are the detector's
    run.train(range(40, 62), t0=T0 + 30, attempt=1, slow_rank=2)
    clock.advance(1)
    evaluator.tick()  # the restart resumes at step 40
    feed = client.get("/dashboard/api/runs/alpha/series", headers=OPERATOR).json()
    kinds = {(m["type"], m["from"], m["to"]) for m in feed["markers"]}
    assert ("spike", 30, 36) in kinds and ("restart", 40, 40) in kinds
    # A spike that came back by itself is shaded too, told apart from the incidents.
    (transient,) = [m for m in feed["markers"] if m["kind"] == "loss_spike_transient"]
    assert (transient["from"], transient["to"]) == (12, 15)
    assert "no rollback" in transient["label"]
    # ... with what it cost against a rollback, as its event stated it
    assert transient["cost"] == ("progress lost 3 steps (1.5 s) vs a rollback 40 steps "
                                 "(20 s): waiting is cheaper")
    (incident,) = [m for m in feed["markers"] if m["kind"] == "loss_spike"]
    assert incident["cost"] is None  # an incident without the figures
    ranks = feed["ranks"]
    assert ranks["attempt"] == 1 and ranks["steps"] == list(range(40, 62))
    assert ranks["series"][0]["rank"] == 2 and ranks["series"][0]["score"] < 0.75
    assert ranks["series"][0]["slow"] is True and ranks["threshold"] == 0.75
    assert len(ranks["median"]) == 22 and feed["mfu"] is None
    steps = client.get("/api/v1/runs/alpha/steps?max_points=10", headers=OPERATOR).json()
    assert len(steps["points"]) <= 10


def test_gpu_health_and_mfu_when_the_run_declares_its_flops(
        client: TestClient, clock: FakeClock) -> None:
    run = SynthRun(client, "gpu").register()
    run.declare_flops(flops_per_sample=2e9, peak_flops_per_rank=1e12)
    gpus = {"available": True, "devices": [
        {"index": 0, "name": "NVIDIA H200", "util_percent": 97, "mem_used_bytes": 70 * 2**30,
         "mem_total_bytes": 141 * 2**30, "temp_c": 64, "power_w": 612.5,
         "ecc_uncorrected": 0},
        {"index": 1, "name": "NVIDIA H200", "util_percent": 12, "mem_used_bytes": 2**30,
         "mem_total_bytes": 141 * 2**30, "temp_c": 88, "power_w": None,
         "ecc_uncorrected": 3}]}
    run.train(range(30), t0=T0, gpus=gpus)
    html = client.get("/runs/gpu", headers=OPERATOR).text
    assert "GPU 0 NVIDIA H200: 97% util, 70.0 GiB / 141.0 GiB, 64 &deg;C, 612.5 W" in html
    assert "3 uncorrected ECC errors" in html
    # 4 ranks x 8 samples a second x 2 GFLOPs / (4 ranks x 1 TFLOP/s) = 1.6%
    assert 'id="chart-mfu"' in html and ">1.6 %</dd>" in html
    feed = client.get("/dashboard/api/runs/gpu/series", headers=OPERATOR).json()
    assert feed["mfu"] == {"unit": "samples", "factor": 2e9 / 4e12}
    # An agent whose NVML cannot start says so, with the reason.
    SynthRun(client, "cpu").register().train(range(3), t0=T0, gpus={
        "available": False, "reason": "NVMLError_LibraryNotFound: NVML Shared Library Not Found"})
    html = client.get("/runs/cpu", headers=OPERATOR).text
    assert "not available (NVML: NVMLError_LibraryNotFound" in html


def test_unchanged_conditional_requests_get_304(client: TestClient, clock: FakeClock) -> None:
    run = SynthRun(client, "alpha").register()
    run.train(range(10), t0=T0)
    url = "/dashboard/api/runs/alpha/state"
    first = client.get(url, headers=OPERATOR)
    tag = first.headers["etag"]
    assert first.status_code == 200 and first.json()["status"] == "running"
    again = client.get(url, headers={**OPERATOR, "If-None-Match": tag})
    assert again.status_code == 304 and again.content == b""
    run.train(range(10, 11), t0=T0)
    changed = client.get(url, headers={**OPERATOR, "If-None-Match": tag})
    assert changed.status_code == 200 and changed.headers["etag"] != tag

    # The run read API gets body-hash ETags too (the charts' steps and ranks).
    for path in ("/api/v1/runs/alpha/steps?max_points=1000", "/api/v1/runs/alpha/ranks",
                 "/dashboard/api/runs/alpha/series"):
        r = client.get(path, headers=OPERATOR)
        assert r.status_code == 200 and r.headers["etag"].startswith('W/"'), path
        r2 = client.get(path, headers={**OPERATOR, "If-None-Match": r.headers["etag"]})
        assert r2.status_code == 304, path
    # ...but never on writes or the agents' routes
    assert "etag" not in run.client.post("/api/v1/ingest", headers=AGENT,
                                         content=b"{}").headers


def test_pages_and_feeds_follow_the_read_rule(client: TestClient) -> None:
    SynthRun(client, "alpha").register().train(range(3), t0=T0)
    for path in ("/", "/runs/alpha"):
        r = client.get(path)
        assert r.status_code == 401 and 'name="token"' in r.text  # the login form
        assert client.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert client.get(path, headers=AGENT).status_code == 200
    for path in ("/runs/alpha/tables", "/dashboard/api/runs/alpha/state",
                 "/dashboard/api/runs/alpha/series"):
        assert client.get(path).status_code == 401, path


# What a browser sends with the login form of the supervisor's own page.
FORM = {"content-type": "application/x-www-form-urlencoded", "origin": "http://testserver"}


def test_login_sets_an_httponly_cookie_that_only_authorises_reads(client: TestClient) -> None:
    SynthRun(client, "alpha").register().train(range(3), t0=T0)
    bad = client.post("/login", content=b"token=nope", headers=FORM)
    assert bad.status_code == 401 and "invalid token" in bad.text
    assert "set-cookie" not in bad.headers
    r = client.post("/login?next=/runs/alpha", content=f"token={OPERATOR_TOKEN}".encode(),
                    headers=FORM, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/runs/alpha"
    cookie = r.headers["set-cookie"].lower()
    assert "httponly" in cookie and "samesite=strict" in cookie and "path=/" in cookie
    assert client.get("/runs/alpha").status_code == 200
    assert client.get("/dashboard/api/runs/alpha/state").status_code == 200
    assert client.get("/api/v1/runs/alpha").status_code == 200
    # a write with only the cookie is refused: the cookie is never a write credential
    assert client.post("/api/v1/runs/alpha/stop", json={"reason": "x"}).status_code == 401
    out = client.post("/logout", headers=FORM, follow_redirects=False)
    assert out.status_code == 303
    client.cookies.clear()
    assert client.get("/runs/alpha").status_code == 401
    # no open redirect after login
    r = client.post("/login?next=//evil.example/", content=f"token={OPERATOR_TOKEN}".encode(),
                    headers=FORM, follow_redirects=False)
    assert r.headers["location"] == "/"


@pytest.mark.parametrize("sender", [{"origin": "http://evil.example"},
                                    {"origin": "null"},
                                    {"referer": "http://evil.example/page"},
                                    {"origin": "http://testserver.evil.example"},
                                    {}])
def test_login_and_logout_from_another_site_are_refused(
        client: TestClient, sender: dict[str, str]) -> None:
    """Login CSRF: a form on another site (or one that hides where it comes from) cannot
    sign this browser in with the forger's token, nor sign it out."""
    headers = {"content-type": "application/x-www-form-urlencoded", **sender}
    r = client.post("/login", content=f"token={OPERATOR_TOKEN}".encode(), headers=headers,
                    follow_redirects=False)
    assert r.status_code == 403 and "not sent from the supervisor" in r.text
    assert "set-cookie" not in r.headers
    assert client.post("/logout", headers=headers, follow_redirects=False).status_code == 403
    # The same form from the supervisor's own page (the Referer alone will do too).
    own = {"content-type": "application/x-www-form-urlencoded",
           "referer": "http://testserver/login"}
    r = client.post("/login", content=f"token={OPERATOR_TOKEN}".encode(), headers=own,
                    follow_redirects=False)
    assert r.status_code == 303 and "set-cookie" in r.headers


def test_token_in_the_query_once_becomes_the_cookie(client: TestClient) -> None:
    SynthRun(client, "alpha").register().train(range(3), t0=T0)
    r = client.get(f"/runs/alpha?token={OPERATOR_TOKEN}&x=1", follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/runs/alpha?x=1"
    assert "httponly" in r.headers["set-cookie"].lower()
    assert client.get("/runs/alpha").status_code == 200
    client.cookies.clear()
    assert client.get("/runs/alpha?token=wrong", follow_redirects=False).status_code == 401


def test_public_reads_need_no_token(db: Database, clock: FakeClock) -> None:
    with TestClient(build_app(db, clock, public_reads=True)) as client:
        SynthRun(client, "alpha").register().train(range(3), t0=T0)
        assert client.get("/").status_code == 200
        page = client.get("/runs/alpha")
        assert page.status_code == 200 and "log in" in page.text
        assert client.get("/dashboard/api/runs/alpha/state").status_code == 200


def test_cookie_survives_tokens_that_need_quoting(db: Database, clock: FakeClock) -> None:
    token = 'op "tok", =x\\'
    with TestClient(build_app(db, clock, operator_token=token)) as client:
        r = client.post("/login", data={"token": token}, headers={"origin": "http://testserver"},
                        follow_redirects=False)
        assert r.status_code == 303, r.text
        assert client.get("/").status_code == 200


def test_every_response_carries_the_security_headers(client: TestClient) -> None:
    SynthRun(client, "alpha").register().train(range(3), t0=T0)
    responses = {
        "page": client.get("/runs/alpha", headers=AGENT),
        "login page": client.get("/runs/alpha"),
        "API": client.get("/api/v1/runs/alpha", headers=AGENT),
        "API 401": client.get("/api/v1/runs/alpha"),
        "API 404": client.get("/api/v1/runs/nope", headers=AGENT),
        "API 422": client.post("/api/v1/ingest", headers=AGENT, json={"seq": -1}),
        "API 413": client.post("/api/v1/ingest", headers=AGENT, content=b"x" * 5_000_000),
        "static": client.get("/static/dashboard.js"),
        "metrics": client.get("/metrics", headers=AGENT),
        "docs": client.get("/docs"),
        "openapi": client.get("/openapi.json"),
        "healthz": client.get("/healthz"),
    }
    for what, r in responses.items():
        csp = r.headers.get("content-security-policy", "")
        assert "default-src 'self'" in csp and "frame-ancestors 'none'" in csp, what
        assert "unsafe-inline" not in csp and "unsafe-eval" not in csp, what
        assert r.headers.get("x-frame-options") == "DENY", what
        assert r.headers.get("x-content-type-options") == "nosniff", what
        assert r.headers.get("referrer-policy") == "same-origin", what
    assert responses["API 413"].status_code == 413


def test_pages_hold_no_inline_script_or_style(client: TestClient) -> None:
    """The policy allows no inline script or style: the pages must not need any."""
    SynthRun(client, "alpha").register().train(range(3), t0=T0, checkpoint_every=1)
    for path in ("/", "/runs/alpha", "/runs/alpha/tables", "/login", "/docs"):
        html = client.get(path, headers=AGENT).text
        assert not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", html), path
        assert "<style" not in html and " style=" not in html, path
        assert not re.search(r"\son[a-z]+=", html), path  # onclick= and the like


def test_api_docs_load_swagger_ui_from_the_supervisor_itself(client: TestClient) -> None:
    page = client.get("/docs")
    assert page.status_code == 200
    srcs = [s.removeprefix("http://testserver")
            for s in re.findall(r'(?:src|href)="([^"]+)"', page.text)]
    assert srcs and all(s.startswith("/") or s.startswith("data:") for s in srcs), srcs
    for asset in ("/static/vendor/swagger-ui/swagger-ui-bundle.js",
                  "/static/vendor/swagger-ui/swagger-ui.css", "/static/docs.js"):
        assert asset in srcs
        assert client.get(asset).status_code == 200, asset
    assert client.get("/redoc").status_code == 404  # FastAPI's CDN page is gone


def test_run_page_shows_why_it_failed_first(client: TestClient, clock: FakeClock,
                                            evaluator: Evaluator) -> None:
    """The newest crash's root cause, whose fault and its traceback come before the charts;
    the worker's text escaped."""
    run = SynthRun(client, "beta").register()
    run.train(range(10), t0=T0)
    frame = {"file": "/home/u/train.py", "line": 57, "function": "collate"}
    run.send(0, [{"type": "exit", "attempt": 0, "t": T0 + 11, "exit_code": 1, "signal": None,
                  "outcome": "crashed", "failed_ranks": [{
                      "rank": 1, "exit_code": 1, "message": "KeyError: 'label'",
                      "root_cause": {"exc_type": "KeyError", "message": "'label'",
                                     "frame": frame, "user_frame": frame, "rank": 1,
                                     "host": "node1", "source": "stderr",
                                     "traceback": "Traceback (most recent call last):\n"
                                                  "  File \"/home/u/train.py\", line 57, in "
                                                  "collate\n    x = d['label'] # <b>\n"
                                                  "KeyError: 'label'"}}]}])
    clock.now = T0 + 12
    evaluator.tick()
    html = client.get("/runs/beta", headers=OPERATOR).text
    assert 'id="failure"' in html and html.index('id="failure"') < html.index('id="chart-loss"')
    assert "KeyError: &#39;label&#39; at train.py:57 in collate (rank 1, host node1)" in html
    assert "the training script" in html
    assert "x = d[&#39;label&#39;] # &lt;b&gt;" in html and "<b>" not in html


def test_a_silent_node_reads_lost_on_the_run_page_with_stale_readings(
        client: TestClient, clock: FakeClock) -> None:
    """What a user saw instead: a SIGKILLed node read ``running`` with its last worker CPU and
    memory 45 s later.  The page says what the API and the CLI say (``node_states``)."""
    run = SynthRun(client, "alpha").register()
    run.train(range(20), t0=T0, clock=clock)
    clock.now += 5
    html = client.get("/runs/alpha", headers=OPERATOR).text
    rows = re.findall(r'<tr data-node="(n\d)" data-state="(\w+)"( class="stale")?>', html)
    assert rows == [("n0", "running", ""), ("n1", "running", "")], rows
    # The page's script refetches the tables when the run's fingerprint changes: a node
    # falling silent past the node-lost deadline changes it, with nothing else stored.
    tag = client.get("/dashboard/api/runs/alpha/state", headers=OPERATOR).headers["etag"]
    clock.now += 31
    assert client.get("/dashboard/api/runs/alpha/state",
                      headers={**OPERATOR, "If-None-Match": tag}).status_code == 200
    clock.now -= 31
    run.train(range(20, 60), t0=T0, nodes=range(1), clock=clock)  # n1 falls silent
    clock.now += 45
    run.send(0, [{"type": "heartbeat", "t": clock.now, "attempt": 0, "state": "running"}])
    html = client.get("/runs/alpha", headers=OPERATOR).text
    rows = re.findall(r'<tr data-node="(n\d)" data-state="(\w+)"( class="stale")?>', html)
    assert rows == [("n0", "running", ""), ("n1", "lost", ' class="stale"')], rows
    n1 = html[html.index('data-node="n1"'):]
    n1 = n1[:n1.index("</tr>")]
    assert 'class="status n-lost">lost<' in n1 and "readings 85 s old" in n1, n1
    assert "last seen, 85 s ago:" in n1 and "198% CPU" in n1  # kept, marked as old

"""The dashboard in a real browser (Debian's Chromium via Playwright): the run page of a live
supervisor subprocess fed through its HTTP API, and the rollback form against stub routes.
Screenshots go to ``test-artifacts/``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import APIRouter, FastAPI, Request

from tests.dashboard.apps import T0, FakeClock, build_app
from tests.dashboard.browser import (
    browser_page,
    login,
    require_browser,
    rollback_via_form,
    screenshot,
    serve_in_thread,
    supervisor_process,
    wait_for_charts,
    wait_for_rollback,
)
from tests.dashboard.synth import OPERATOR, OPERATOR_TOKEN, SynthRun
from tests.waiting import wait_for
from trainwarden.supervisor.store.db import Database


def feed_demo_run(client: httpx.Client, name: str, t0: float) -> SynthRun:
    """120 steps with a loss spike at 60-70 and a slow rank, checkpoints every 25 steps, then
    a crash; the live evaluator restarts the run, which resumes at step 100."""
    run = SynthRun(client, name).register()
    run.train(range(120), t0=t0, spike=(60, 70), slow_rank=3, checkpoint_every=25, dt=0.5)
    run.crash(node=1, rank=3, t=t0 + 61)
    wait_for(lambda: client.get(f"/api/v1/runs/{name}", headers=OPERATOR).json()["attempt"]
             == 1, 20, "the live evaluator's restart")
    run.train(range(100, 140), t0=t0 + 20, attempt=1, slow_rank=3, dt=0.5)
    return run


def test_run_page_of_a_live_supervisor(tmp_path: Path) -> None:
    require_browser()
    # The synthetic history is fed in seconds: no automatic rollback of its spike (the page,
    # not the policy, is under test here), and no hang call on its old timestamps.
    # Its agents go quiet once it is fed: no node-lost call either, so the run stays unchanged
    # and the page's conditional polls get 304.
    env = {"TRAINWARDEN_ROLLBACK_BUDGET": "0", "TRAINWARDEN_HANG_FLOOR_S": "600",
           "TRAINWARDEN_NODE_LOST_S": "3600"}
    with supervisor_process(tmp_path, agent_token="agent-secret", operator_token=OPERATOR_TOKEN,
                            env=env) as sup, sup.client() as client:
        feed_demo_run(client, "demo", time.time() - 90)
        wait_for(lambda: client.get("/api/v1/runs/demo/actions", headers=OPERATOR)
                 .json()["actions"][0]["status"] == "resumed", 20, "the restart to resume")
        with browser_page() as page:
            login(page, sup.base_url, OPERATOR_TOKEN)
            assert page.locator("#runs a", has_text="demo").count() == 1
            screenshot(page, "dashboard-runs")
            page.goto(f"{sup.base_url}/runs/demo")
            wait_for_charts(page)
            page.wait_for_selector("#chart-throughput canvas")
            page.wait_for_selector("#chart-ranks canvas")
            legend = page.locator("#chart-loss .u-legend").inner_text()
            assert "attempt 0" in legend and "attempt 1" in legend
            assert "rank 3" in page.locator("#chart-ranks .u-legend").inner_text()
            crash = page.locator("#incidents tr", has_text="crash")
            assert crash.count() == 1 and "rank 3" in crash.inner_text()
            assert page.locator("#checkpoints form.rollback").count() == 4  # attempt 0: 25..100
            assert page.locator("#actions", has_text="resumed").count() == 1
            assert page.locator("#mfu-value", has_text="n/a").count() == 1  # not declared
            assert page.locator("#nodes", has_text="% CPU").count() == 1
            # polling an unchanged run: conditional requests answered 304, the page intact
            page.wait_for_event("response", lambda r: "/dashboard/api/runs/demo/state" in r.url
                                and r.status == 304, timeout=10_000)
            assert page.locator("#chart-loss canvas").count() >= 1
            assert page.errors == [], page.errors
            screenshot(page, "dashboard-run")


def _stub_rollback(app: FastAPI, seen: list[dict[str, Any]]) -> None:
    """``POST /api/v1/runs/{run}/rollback`` and ``GET /api/v1/actions/{id}`` stand-ins, put
    in front of the app's own routes."""
    stub = APIRouter()
    polls = {"n": 0}

    @stub.post("/api/v1/runs/{run}/rollback", status_code=202)
    async def rollback(run: str, request: Request) -> dict[str, Any]:
        seen.append({"run": run, "auth": request.headers.get("authorization"),
                     "body": await request.json()})
        return {"action_id": 99}

    @stub.get("/api/v1/actions/{action_id}")
    def action(action_id: int) -> dict[str, Any]:
        polls["n"] += 1
        steps = ["queued", "delivered", "restarted", "resumed"]
        status = steps[min(polls["n"] - 1, 3)]
        return {"id": action_id, "kind": "rollback", "status": status,
                "progress": {s: T0 for s in steps[: steps.index(status) + 1]},
                "resumed_step": 40 if status == "resumed" else None}

    routes = app.router.routes
    before = len(routes)
    app.include_router(stub)
    added = routes[before:]
    del routes[before:]
    routes[:0] = added


def test_rollback_form_posts_and_follows_the_action(db: Database) -> None:
    require_browser()
    app = build_app(db, FakeClock())
    seen: list[dict[str, Any]] = []
    _stub_rollback(app, seen)
    with serve_in_thread(app) as base, httpx.Client(base_url=base) as client:
        SynthRun(client, "alpha").register().train(range(60), t0=T0, checkpoint_every=20)
        with browser_page() as page:
            page.on("dialog", lambda d: d.accept())
            login(page, base, "agent-secret", "/runs/alpha")  # read-only login
            wait_for_charts(page)
            rollback_via_form(page, checkpoint_step=20, operator_token=OPERATOR_TOKEN,
                              reason="loss spike at 30", skip="100-120, 130-140",
                              lr_scale=0.25, screenshot_name="dashboard-rollback-dialog")
            text = wait_for_rollback(page, timeout_ms=15_000)
            assert "action #99" in text and "resumed at step 40" in text
            assert page.evaluate("sessionStorage.getItem('trainwarden.operator_token')") \
                == OPERATOR_TOKEN
            assert page.errors == [], page.errors
            screenshot(page, "dashboard-rollback-progress")
    assert seen == [{"run": "alpha", "auth": f"Bearer {OPERATOR_TOKEN}",
                     "body": {"checkpoint": 1, "skip": [[100, 120], [130, 140]],
                              "lr_scale": 0.25, "lr_scale_steps": 200, "lr_ramp_steps": 100,
                              "reason": "loss spike at 30"}}]


def test_the_pages_run_under_the_content_security_policy(db: Database) -> None:
    """The policy is on (no inline script or style allowed): the run page draws its charts
    and the API docs render Swagger UI from the vendored assets, with no violation; an inline
    style smuggled into the page is refused (so a violation would show here)."""
    require_browser()
    app = build_app(db, FakeClock())
    with serve_in_thread(app) as base, httpx.Client(base_url=base) as client:
        SynthRun(client, "alpha").register().train(range(60), t0=T0, checkpoint_every=20)
        with browser_page() as page:
            login(page, base, OPERATOR_TOKEN, "/runs/alpha")
            wait_for_charts(page)
            page.goto(f"{base}/docs")
            page.wait_for_selector(".swagger-ui .opblock", timeout=15_000)
            page.locator(".opblock-summary-path", has_text="/api/v1/ingest").first.click()
            page.wait_for_selector(".opblock.is-open .model-example", timeout=10_000)
            screenshot(page, "api-docs")
            assert page.errors == [], page.errors
            page.evaluate("""() => { const d = document.createElement("div");
                                      d.innerHTML = '<p style="color: red">x</p>';
                                      document.body.appendChild(d); }""")
            wait_for(lambda: page.errors, 5, "the violation to be reported")
            assert any("style-src" in e for e in page.errors), page.errors


def test_a_login_form_on_another_site_is_refused(db: Database, tmp_path: Path) -> None:
    """Login CSRF in a real browser: a page on another origin posts the forger's token to
    /login; the supervisor refuses it and the browser gets no cookie."""
    require_browser()
    import http.server
    import threading

    app = build_app(db, FakeClock())
    with serve_in_thread(app) as base:
        (tmp_path / "evil.html").write_text(
            f'<form method="post" action="{base}/login"><input name="token" '
            f'value="{OPERATOR_TOKEN}"><button id="go">win a prize</button></form>')
        handler = lambda *a, **kw: http.server.SimpleHTTPRequestHandler(  # noqa: E731
            *a, directory=str(tmp_path), **kw)
        evil = http.server.ThreadingHTTPServer(("localhost", 0), handler)
        th = threading.Thread(target=evil.serve_forever, daemon=True)
        th.start()
        try:
            with browser_page() as page:
                page.goto(f"http://localhost:{evil.server_address[1]}/evil.html")
                with page.expect_response(lambda r: r.url.startswith(f"{base}/login")) as resp:
                    page.click("#go")
                assert resp.value.status == 403
                assert "not sent from the supervisor" in page.content()
                assert [c for c in page.context.cookies() if c["name"] == "trainwarden_token"] \
                    == []
        finally:
            evil.shutdown()
            evil.server_close()


def test_why_it_failed_appears_on_an_open_run_page_without_a_reload(tmp_path: Path) -> None:
    """The person paged may have the run page open already: a crash with its root cause shows
    in the "Why it failed" block, above the charts, at the page's next poll."""
    require_browser()
    env = {"TRAINWARDEN_HANG_FLOOR_S": "600", "TRAINWARDEN_NODE_LOST_S": "3600"}
    with supervisor_process(tmp_path, agent_token="agent-secret", operator_token=OPERATOR_TOKEN,
                            env=env) as sup, sup.client() as client:
        t0 = time.time() - 60
        run = SynthRun(client, "live").register()
        run.train(range(30), t0=t0, checkpoint_every=10, dt=0.5)
        with browser_page() as page:
            login(page, sup.base_url, OPERATOR_TOKEN)
            page.goto(f"{sup.base_url}/runs/live")
            wait_for_charts(page)
            assert page.locator("#failure").count() == 0
            frame = {"file": "/home/u/train.py", "line": 57, "function": "collate"}
            run.send(0, [{"type": "exit", "attempt": 0, "t": time.time(), "exit_code": 1,
                          "signal": None, "outcome": "crashed", "failed_ranks": [{
                              "rank": 1, "exit_code": 1, "message": "KeyError: 'label'",
                              "root_cause": {"exc_type": "KeyError", "message": "'label'",
                                             "frame": frame, "user_frame": frame, "rank": 1,
                                             "host": "node1", "source": "stderr",
                                             "traceback": "KeyError: 'label'"}}]}])
            page.wait_for_selector("#failure", timeout=20_000)
            text = page.locator("#failure").inner_text()
            assert "KeyError: 'label' at train.py:57 in collate (rank 1, host node1)" in text
            box, chart = (page.locator(s).bounding_box() for s in ("#failure", "#chart-loss"))
            assert box is not None and chart is not None and box["y"] < chart["y"]
            assert page.errors == [], page.errors
            screenshot(page, "dashboard-why-it-failed")


def _node(client: httpx.Client, run: str, node: str, **extra: Any) -> dict[str, str]:
    """Register ``node`` of a two-node torchrun run; its headers for ingest."""
    from tests.dashboard.synth import AGENT

    r = client.post("/api/v1/agents/register", headers=AGENT, json={
        "run": run, "node": node, "command": ["torchrun", "--nnodes=2", "train.py"],
        "nproc_per_node": 1, "checkpoint_roots": ["/ck"], **extra})
    assert r.status_code == 200, r.text
    return {**AGENT, "X-Trainwarden-Agent-Credential": r.json()["credential"],
            "agent-id": str(r.json()["agent_id"])}


def _send(client: httpx.Client, h: dict[str, str], seq: int, items: list[Any],
          attempt: int = 0) -> None:
    headers = {k: v for k, v in h.items() if k != "agent-id"}
    r = client.post("/api/v1/ingest", headers=headers, json={
        "agent_id": int(h["agent-id"]), "seq": seq, "attempt": attempt, "items": items})
    assert r.status_code == 200, r.text


def test_a_waiting_and_a_shrunk_run_say_so_at_a_glance(db: Database) -> None:
    """Two runs lose node n1 with no spare: one waits for a node, one (``--min-nodes 1``)
    shrinks.  The runs list marks them WAITING and SHRUNK; each run page's headline says
    which node rank waits and how to end the wait, or how many nodes it runs on, since when,
    and what grows it back."""
    require_browser()
    clock = FakeClock()
    app = build_app(db, clock)
    evaluator = app.state.evaluator
    with serve_in_thread(app) as base, httpx.Client(base_url=base) as client:
        nodes: dict[tuple[str, str], dict[str, str]] = {}
        for run, extra in (("waits", {}), ("shrinks", {"min_nodes": 1})):
            for n in ("n0", "n1"):
                nodes[(run, n)] = _node(client, run, n, **extra)
            for rank, n in enumerate(("n0", "n1")):
                items: list[Any] = [{"type": "step", "rank": rank, "world_size": 2, "step": 0,
                                     "t": clock.now, "loss": 1.0}]
                if n == "n0":
                    items.append({"type": "checkpoint", "step": 1, "path": "/ck/1",
                                  "bytes": 5, "t": clock.now, "lineage": "a0"})
                _send(client, nodes[(run, n)], 0, items)
        evaluator.tick()
        clock.advance(40)  # n1 silent past the node-lost deadline, in both runs
        for run in ("waits", "shrinks"):
            _send(client, nodes[(run, "n0")], 1, [])
        evaluator.tick()
        with browser_page() as page:
            login(page, base, OPERATOR_TOKEN, "/")
            waits = page.locator("#runs tr", has_text="waits").locator("[data-condition]")
            shrinks = page.locator("#runs tr", has_text="shrinks").locator("[data-condition]")
            assert waits.inner_text() == "WAITING" and shrinks.inner_text() == "SHRUNK"
            assert "start `trainwarden agent --spare`" in (waits.get_attribute("title") or "")
            screenshot(page, "dashboard-runs-waiting-shrunk")
            page.goto(f"{base}/runs/waits")
            line = page.locator("#run-condition").inner_text()
            assert line.startswith("WAITING for a node (node rank 1: n1 lost); no spare "
                                   "configured: start `trainwarden agent --spare`"), line
            screenshot(page, "dashboard-run-waiting", full_page=False)
            page.goto(f"{base}/runs/shrinks")
            line = page.locator("#run-condition").inner_text()
            assert line.startswith("SHRUNK to 1 of 2 declared nodes; it grows back at its "
                                   "next checkpoint once a node is free"), line
            assert "since" in line
            screenshot(page, "dashboard-run-shrunk", full_page=False)
            assert page.errors == [], page.errors

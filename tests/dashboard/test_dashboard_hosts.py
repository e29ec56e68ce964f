"""The dashboard's hosts page: every known node with its state, reason and evidence; the
cordon/uncordon dialog for a signed-in operator only, and driven in a real browser; names
escaped; a run-scoped token refused (hosts serve every run)."""

from __future__ import annotations

import re

import httpx
from fastapi.testclient import TestClient

from tests.dashboard.apps import T0, FakeClock, build_app
from tests.dashboard.browser import (
    browser_page,
    login,
    require_browser,
    screenshot,
    serve_in_thread,
)
from tests.dashboard.synth import OPERATOR, OPERATOR_TOKEN, SynthRun
from tests.waiting import wait_for
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store import hosts
from trainwarden.supervisor.store.db import Database


def test_the_hosts_page_shows_each_nodes_state_and_evidence(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    run = SynthRun(client, "alpha").register()  # nodes n0, n1
    run.train(range(5), t0=T0)
    run.send(1, [{"type": "event", "attempt": 0, "rank": 2, "t": T0 + 5, "name": "preflight",
                  "details": {"passed": False, "failed": "nccl_allreduce", "checks": []}}])
    clock.now = T0 + 10
    evaluator.tick()  # the failed preflight: n1 cordoned by the policy
    r = client.post("/api/v1/hosts/spare%3Cb%3E/cordon", headers=OPERATOR,
                    json={"reason": "fans <failing>"})
    assert r.status_code == 200, r.text
    clock.now = T0 + 70

    page = client.get("/hosts", headers=OPERATOR)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    html = page.text
    rows = dict(re.findall(r'<tr data-node="([^"]*)" data-state="(\w+)">', html))
    assert rows == {"n0": "healthy", "n1": "cordoned", "spare&lt;b&gt;": "cordoned"}
    assert 'href="/hosts"' in html  # in the navigation
    n1 = html[html.index('<tr data-node="n1"'):]
    n1 = n1[:n1.index("</tr>")]
    assert "cordon.on_failed_preflight: failed a preflight (nccl_allreduce) at " in n1
    assert ">policy<" in n1 and "60 s ago" in n1
    assert '<td class="n">1</td>' in n1
    # the signed-in operator gets the forms: uncordon a cordoned node, cordon a healthy one
    assert 'data-node="n1" data-action="uncordon"' in n1
    assert 'data-node="n0" data-action="cordon"' in html
    assert 'id="host-dialog"' in html
    # what an operator typed is shown, escaped
    assert "fans &lt;failing&gt;" in html and "<failing>" not in html and "spare<b>" not in html


def test_only_an_operator_gets_the_forms_and_a_scoped_token_is_refused(
        db: Database, clock: FakeClock) -> None:
    admin = {"Authorization": "Bearer admin-secret"}
    with TestClient(build_app(db, clock, admin_token="admin-secret")) as client:
        SynthRun(client, "alpha").register()

        def token(name: str, role: str, scope: str | None = None) -> dict[str, str]:
            r = client.post("/api/v1/tokens", headers=admin,
                            json={"name": name, "role": role, "scope": scope})
            assert r.status_code == 201, r.text
            return {"Authorization": f"Bearer {r.json()['token']}"}

        viewer, scoped = token("v", "viewer"), token("s", "operator", "alpha")
        html = client.get("/hosts", headers=viewer).text
        assert '<tr data-node="n0" data-state="healthy">' in html
        assert "host-change" not in html and 'id="host-dialog"' not in html
        assert "Sign in with an operator token" in html
        assert 'id="host-dialog"' in client.get("/hosts", headers=admin).text
        r = client.get("/hosts", headers=scoped)
        assert r.status_code == 403 and "scoped" in r.text
        r = client.get("/hosts")
        assert r.status_code == 401 and 'name="token"' in r.text  # the sign-in form


def test_an_operator_cordons_and_uncordons_through_the_dialog_in_a_browser(
        db: Database) -> None:
    """The hosts page in a real browser: the dialog sends the reason with the operator token
    it asks for; a refusal is shown in the dialog, nothing changed."""
    require_browser()
    app = build_app(db, FakeClock())
    with serve_in_thread(app) as base, httpx.Client(base_url=base) as client:
        SynthRun(client, "alpha").register()
        with browser_page() as page:
            login(page, base, OPERATOR_TOKEN, "/hosts")

            def change(node: str, action: str, reason: str, token: str) -> None:
                page.locator(f"form.host-change[data-node='{node}'] button").click()
                page.locator("#host-dialog").wait_for(state="visible")
                page.fill("#host-form input[name=reason]", reason)
                page.fill("#host-form input[name=operator_token]", token)
                page.click("#host-confirm")

            change("n0", "cordon", "fans failing", "not-the-token")
            err = page.locator("#host-dialog [data-field=error]")
            err.wait_for(state="visible")
            wait_for(lambda: "HTTP 401" in err.inner_text(), 10, "the refusal in the dialog")
            page.click("#host-dialog button[value=cancel]")
            assert page.locator("tr[data-node='n0'][data-state='healthy']").count() == 1

            change("n0", "cordon", "fans failing", OPERATOR_TOKEN)
            page.wait_for_selector("tr[data-node='n0'][data-state='cordoned']")
            assert "fans failing" in page.locator("tr[data-node='n0']").inner_text()
            screenshot(page, "dashboard-hosts")
            change("n0", "uncordon", "fans replaced", OPERATOR_TOKEN)
            page.wait_for_selector("tr[data-node='n0'][data-state='probation']")
            assert "waiting for a preflight" in page.locator("tr[data-node='n0']").inner_text()
            # (the 401 above is the one console error: the browser logs the refused request)
            assert [e for e in page.errors if "401" not in e] == [], page.errors
    with db.read() as c:
        assert [(a["kind"], a["actor"], a["reason"]) for a in hosts.host_actions(c, "n0")] == [
            ("uncordon", "operator", "fans replaced"), ("cordon", "operator", "fans failing")]

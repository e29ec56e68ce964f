"""The run page's loss chart reads at a glance, in a real browser: a loss
spike of 1e4 leaves the normal curve a readable band (log axis), the labels of markers close
together (a spike, restarts, rollbacks a few steps apart) never overlap, and the goodput bar
stands beside the chart."""

from __future__ import annotations

import re
from typing import Any

import httpx

from tests.dashboard.apps import T0, FakeClock, build_app
from tests.dashboard.browser import (
    browser_page,
    login,
    require_browser,
    screenshot,
    serve_in_thread,
    wait_for_charts,
)
from tests.dashboard.synth import OPERATOR_TOKEN, SynthRun, loss_at, step_item
from trainwarden.supervisor.enums import ActionKind, ActionStatus
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry
from trainwarden.supervisor.store.db import Database

SPIKE = (60, 62)
# restarts and rollbacks resumed within a few steps of each other and of the spike
RESUMED = [(58, 1), (59, 2), (60, 3), (61, 4), (63, 5), (64, 6)]


def seed(client: httpx.Client, db: Database) -> None:
    SynthRun(client, "spiky").register().train(range(120), t0=T0, spike=SPIKE, spike_to=1e4,
                                               checkpoint_every=10)
    with db.write() as conn:
        r = registry.get_run_by_name(conn, name="spiky")
        assert r is not None
        rec.open_incident(conn, run_id=r["id"], kind="loss_spike", cause="loss 1e4",
                           attempt=0, opened_at=T0 + 63,
                           details={"start_step": SPIKE[0], "step": SPIKE[1]})
        rec.insert_event(conn, run_id=r["id"], attempt=0, t=T0 + 57, step=57,
                          name="loss_spike_transient", message="transient loss spike",
                          details={"start_step": 57, "recovered_at_step": 58})
        for step, attempt in RESUMED:
            rec.create_action(conn, run_id=r["id"], kind=ActionKind.RESTART,
                               reason="test", actor="policy", status=ActionStatus.RESUMED,
                               attempt=attempt, created_at=T0 + 64, resumed_step=step,
                               rollback_to_step=step if attempt % 2 else None)


CHART = """() => {
  const c = window.trainwardenCharts && window.trainwardenCharts["chart-loss"];
  if (!c) return null;
  const u = c.u, el = document.getElementById("chart-loss");
  const labels = [...el.querySelectorAll(".chart-label")].map(e => {
    const b = e.getBoundingClientRect();
    return {text: e.textContent, l: b.left, r: b.right, t: b.top, b: b.bottom};
  });
  const over = u.over.getBoundingClientRect();
  return {distr: u.scales.y.distr, height: over.height, top: over.top, bottom: over.bottom,
          left: over.left, right: over.right,
          labels: labels,
          note: document.getElementById("chart-loss-note").textContent};
}"""


def _intersect(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["l"] < b["r"] and b["l"] < a["r"] and a["t"] < b["b"] and b["t"] < a["b"]


def test_loss_chart_log_axis_and_labels_that_do_not_overlap(db: Database) -> None:
    require_browser()
    clock = FakeClock()
    app = build_app(db, clock)
    with serve_in_thread(app) as base, httpx.Client(base_url=base) as client:
        seed(client, db)
        clock.now = T0 + 125  # within the node-lost deadline: the run stays as seeded
        app.state.evaluator.tick()  # accounts the run's goodput
        with browser_page() as page:
            login(page, base, OPERATOR_TOKEN, "/runs/spiky")
            wait_for_charts(page)
            chart = page.evaluate(CHART)
            assert chart is not None, "the page exposes no loss chart"
            # the y axis is logarithmic (uPlot distr 3)
            assert chart["distr"] == 3, chart["distr"]
            # the normal loss (the mean over ranks, outside the spike) spans a meaningful part
            # of the plot height: with a linear axis up to 1e4 it would be under 0.1%
            normal = [sum(loss_at(s, r, None, None) for r in range(4)) / 4
                      for s in range(120) if not SPIKE[0] <= s <= SPIKE[1]]
            span = page.evaluate("""([lo, hi]) => {
              const u = window.trainwardenCharts["chart-loss"].u;
              return Math.abs(u.valToPos(lo, "y") - u.valToPos(hi, "y"));
            }""", [min(normal), max(normal)])
            assert span / chart["height"] >= 0.10, (span, chart["height"])
            # the spike's peak is still on the plot
            peak_y = page.evaluate("""() => window.trainwardenCharts["chart-loss"].u
                                      .valToPos(1e4, "y")""")
            assert 0 <= peak_y <= chart["height"], peak_y
            assert "log axis" in chart["note"]
            # every marker label is a box inside the plot, and no two intersect
            labels = chart["labels"]
            texts = [lab["text"] for lab in labels]
            assert len(labels) >= 8, texts  # spike, transient spike, six restarts
            assert sum("restart #" in t for t in texts) == len(RESUMED), texts
            assert any("loss_spike #" in t for t in texts), texts
            for lab in labels:
                assert chart["left"] - 0.5 <= lab["l"] and lab["r"] <= chart["right"] + 0.5, lab
                assert chart["top"] - 0.5 <= lab["t"] and lab["b"] <= chart["bottom"] + 0.5, lab
            overlaps = [(a["text"], b["text"]) for i, a in enumerate(labels)
                        for b in labels[i + 1:] if _intersect(a, b)]
            assert overlaps == [], overlaps
            # beside it, the goodput bar: one segment per part with time, filling the bar
            bar = page.evaluate("""() => {
              const bar = document.querySelector("#goodput .goodput-bar");
              const segs = [...bar.querySelectorAll(".seg")];
              return {width: bar.clientWidth, parts: segs.map(e => e.dataset.part),
                      sum: segs.reduce((a, e) => a + e.getBoundingClientRect().width, 0),
                      head: document.querySelector("#goodput .goodput-head").textContent,
                      legend: document.querySelector("#goodput .goodput-legend").textContent};
            }""")
            assert "productive" in bar["parts"] and "lost_progress" in bar["parts"], bar
            assert abs(bar["sum"] - bar["width"]) <= 2, bar
            assert bar["head"].startswith("ETTR "), bar
            assert "not measured" not in bar["legend"], bar
            assert re.search(r"idle: \d", bar["legend"]), bar  # measured (seconds)
            assert page.errors == [], page.errors
            screenshot(page, "dashboard-loss-chart")


def test_a_loss_below_zero_gets_a_robust_linear_axis_with_the_peak_annotated(
        db: Database) -> None:
    """A log axis cannot show a loss <= 0: the chart falls back to a linear axis whose range
    ignores the 1e4 outlier, and says where the clipped peak was."""
    require_browser()
    app = build_app(db, FakeClock())
    with serve_in_thread(app) as base, httpx.Client(base_url=base) as client:
        run = SynthRun(client, "negative").register()
        run.train(range(120), t0=T0, spike=SPIKE, spike_to=1e4)
        for n in range(run.nodes):
            run.send(n, [step_item(n * 2 + lr, 120, t=T0 + 120, local_rank=lr, loss=-0.5)
                         for lr in range(2)])
        with browser_page() as page:
            login(page, base, OPERATOR_TOKEN, "/runs/negative")
            wait_for_charts(page)
            chart = page.evaluate(CHART)
            assert chart["distr"] == 1, chart["distr"]
            normal = [sum(loss_at(s, r, None, None) for r in range(4)) / 4
                      for s in range(120) if not SPIKE[0] <= s <= SPIKE[1]]
            span = page.evaluate("""([lo, hi]) => {
              const u = window.trainwardenCharts["chart-loss"].u;
              return Math.abs(u.valToPos(lo, "y") - u.valToPos(hi, "y"));
            }""", [min(normal), max(normal)])
            assert span / chart["height"] >= 0.5, (span, chart["height"])
            texts = [lab["text"] for lab in chart["labels"]]
            assert any(t.startswith("peak 1.0e+4") for t in texts), texts
            assert "linear axis" in chart["note"] and "step 60" in chart["note"], chart["note"]
            assert page.errors == [], page.errors

"""Prometheus metrics: a collector that reads the store at scrape time, and the supervisor's
own request metrics.

The exported names and labels are a contract (``deploy/prometheus/alerts.yml`` and the
Grafana dashboard are written against them); change them only together.

Cardinality: per run a fixed set of series (7 incident kinds, 6 restart causes), per agent
(node) two, and at most ``STRAGGLER_TOP`` rank series (the lowest straggler scores).  Only runs
that are active, or whose status changed in the last ``RECENT_S`` seconds, are exported.

Derived values: a restart's ``cause`` is the kind of the incident its action answers
(loss_spike/nonfinite -> "spike"), "operator" for an operator's action, "other" for anything
else; ``restarts_without_progress`` counts, from the newest ended attempt backwards, the
attempts started by a restart whose highest step did not pass the highest step of every
earlier attempt (the running attempt ends the streak once it passes, and is not counted
while it has not).

Not exported: ``trainwarden_agent_disk_free_ratio`` (agents report free bytes of the
checkpoint root, not its total size, so there is no ratio to give).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from sqlalchemy import Connection

from supervisor.api.deps import ReadAuth
from supervisor.evaluator import Clock
from supervisor.store import repo
from supervisor.store.db import Database

ACTIVE_STATUSES = ("running", "restarting")
RECENT_S = 24 * 3600.0
INCIDENT_KINDS = ("crash", "hang", "collective_timeout", "node_lost", "straggler",
                  "loss_spike", "nonfinite")
RESTART_CAUSES = ("crash", "hang", "spike", "operator", "node_lost", "collective_timeout")
# Incident kind -> restart cause label; anything else is "other".
_CAUSE_OF_KIND = {"crash": "crash", "hang": "hang", "loss_spike": "spike", "nonfinite": "spike",
                  "spike": "spike", "node_lost": "node_lost",
                  "collective_timeout": "collective_timeout"}
STRAGGLER_WINDOW = 20  # steps of per-rank timings behind a straggler score
STRAGGLER_TOP = 16  # rank series exported per run: the lowest scores
INGEST_PATH = "/api/v1/ingest"
INGEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# ---------------------------------------------------------------------------------------------
# derived values (pure)


def restart_cause(action: dict[str, Any]) -> str:
    """The ``cause`` label of one restart action."""
    if action.get("actor") == "operator":
        return "operator"
    return _CAUSE_OF_KIND.get(str(action.get("incident_kind") or ""), "other")


def restarts_without_progress(max_steps: dict[int, int], current_attempt: int,
                              restarted: Iterable[int]) -> int:
    """Restarts in a row whose attempt did not pass the highest step reached before it.

    ``restarted``: the attempts a restart started.  An ended attempt (below the current one)
    that did not pass the previous high counts; the current attempt resets the streak once it
    passes the previous high and does not count while it has not (it may still)."""
    started = sorted(a for a in set(restarted) if 0 < a <= current_attempt)

    def high_before(attempt: int) -> int:
        return max((s for a, s in max_steps.items() if a < attempt), default=-1)

    if current_attempt in started:
        cur = max_steps.get(current_attempt)
        if cur is not None and cur > high_before(current_attempt):
            return 0
    streak = 0
    for a in reversed([a for a in started if a < current_attempt]):
        reached = max_steps.get(a)
        if reached is not None and reached > high_before(a):
            break
        streak += 1
    return streak


def straggler_scores(rows: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Median-based score per rank over per-rank timing rows (``rank``, ``data_s``,
    ``compute_s``): median over ranks of the mean pre-collective time / this rank's mean.
    1.0 is typical, below ~0.75 a straggler.  Ranks without timings get no score."""
    sums: dict[int, list[float]] = {}
    for r in rows:
        d, c = r.get("data_s"), r.get("compute_s")
        if d is None and c is None:
            continue
        sums.setdefault(int(r["rank"]), []).append(float(d or 0.0) + float(c or 0.0))
    means = {rank: sum(v) / len(v) for rank, v in sums.items()}
    if len(means) < 2:
        return {}
    med = statistics.median(means.values())
    return {rank: (med / m if m > 0 else 1.0) for rank, m in means.items()}


def run_scores(conn: Connection, run_id: int, newest: dict[str, Any] | None
               ) -> dict[int, float]:
    """Straggler scores of the newest attempt's last ``STRAGGLER_WINDOW`` steps."""
    if newest is None:
        return {}
    rows = repo.rank_phase_rows(conn, run_id=run_id, attempt=int(newest["attempt"]),
                                step_from=int(newest["step"]) - STRAGGLER_WINDOW + 1)
    return straggler_scores(rows)


def mean_loss(agg: dict[str, Any]) -> float | None:
    if agg.get("loss_nonfinite"):
        return math.nan
    n = agg.get("loss_count") or 0
    return agg["loss_sum"] / n if n and agg.get("loss_sum") is not None else None


# ---------------------------------------------------------------------------------------------
# the store collector


class _Families:
    def __init__(self) -> None:
        g = GaugeMetricFamily
        self.info = g("trainwarden_run_info", "Run status (always 1)", labels=["run", "status"])
        self.active = g("trainwarden_run_active", "1 while running or restarting",
                        labels=["run"])
        self.step = g("trainwarden_run_step", "Newest reported step", labels=["run"])
        self.attempt = g("trainwarden_run_attempt", "Current attempt", labels=["run"])
        self.loss = g("trainwarden_run_loss", "Newest mean loss (NaN when non-finite)",
                      labels=["run"])
        self.throughput = g("trainwarden_run_throughput_samples_per_second",
                            "Samples per second over the newest steps", labels=["run"])
        self.since_step = g("trainwarden_run_seconds_since_last_step",
                            "Seconds since the newest step report (since creation before one)",
                            labels=["run"])
        self.ckpt_age = g("trainwarden_run_checkpoint_age_seconds",
                          "Age of the newest complete checkpoint", labels=["run"])
        self.restarts = CounterMetricFamily("trainwarden_run_restarts",
                                            "Restarts by cause", labels=["run", "cause"])
        self.budget = g("trainwarden_run_restart_budget_remaining",
                        "Restarts left in the run's budget", labels=["run"])
        self.incidents = g("trainwarden_run_open_incidents", "Open incidents by kind",
                           labels=["run", "kind"])
        self.no_progress = g("trainwarden_run_restarts_without_progress",
                             "Restarts in a row that did not pass the previous highest step",
                             labels=["run"])
        self.straggler = g("trainwarden_rank_straggler_score",
                           f"Median-based straggler score (the {STRAGGLER_TOP} lowest per run)",
                           labels=["run", "rank", "node"])
        self.hb_age = g("trainwarden_agent_heartbeat_age_seconds",
                        "Seconds since the agent was last heard from", labels=["run", "node"])
        self.disk = g("trainwarden_agent_disk_free_bytes",
                      "Free bytes of the checkpoint root", labels=["run", "node"])

    def all(self) -> list[Metric]:
        return [self.info, self.active, self.step, self.attempt, self.loss, self.throughput,
                self.since_step, self.ckpt_age, self.restarts, self.budget, self.incidents,
                self.no_progress, self.straggler, self.hb_age, self.disk]


class StoreCollector(Collector):
    """Reads the store at scrape time (one read transaction per scrape)."""

    def __init__(self, db: Database, clock: Clock = time.time, *, restart_budget: int = 10
                 ) -> None:
        self.db = db
        self.clock = clock
        self.restart_budget = restart_budget

    def collect(self) -> Iterator[Metric]:
        f = _Families()
        now = self.clock()
        with self.db.read() as conn:
            for run in repo.runs_for_metrics(conn, active=ACTIVE_STATUSES, since=now - RECENT_S):
                self._run(conn, f, run, now)
        yield from f.all()

    def _run(self, conn: Connection, f: _Families, run: dict[str, Any], now: float) -> None:
        name, run_id = str(run["name"]), int(run["id"])
        f.info.add_metric([name, str(run["status"])], 1)
        f.active.add_metric([name], 1 if run["status"] in ACTIVE_STATUSES else 0)
        f.attempt.add_metric([name], run["attempt"])
        f.budget.add_metric([name], max(0, self.restart_budget - int(run["restarts"])))
        newest = repo.newest_step(conn, run_id=run_id)
        if newest is not None:
            f.step.add_metric([name], newest["step"])
            loss = mean_loss(newest)
            if loss is not None:
                f.loss.add_metric([name], loss)
            tp = repo.throughput(conn, run_id=run_id, attempt=int(newest["attempt"]))
            if tp["samples_per_s"] is not None:
                f.throughput.add_metric([name], tp["samples_per_s"])
        f.since_step.add_metric(
            [name], max(0.0, now - (newest["t_last"] if newest else run["created_at"])))
        ckpt = repo.newest_complete_checkpoint(conn, run_id=run_id)
        if ckpt is not None:
            f.ckpt_age.add_metric([name], max(0.0, now - ckpt["t"]))
        restarts = repo.restart_actions(conn, run_id=run_id)
        by_cause = dict.fromkeys(RESTART_CAUSES, 0)
        for a in restarts:
            cause = restart_cause(a)
            by_cause[cause] = by_cause.get(cause, 0) + 1
        for cause, n in by_cause.items():
            f.restarts.add_metric([name, cause], n)
        counts = repo.open_incident_counts(conn, run_id=run_id)
        for kind in dict.fromkeys([*INCIDENT_KINDS, *counts]):
            f.incidents.add_metric([name, kind], counts.get(kind, 0))
        f.no_progress.add_metric([name], restarts_without_progress(
            repo.max_step_by_attempt(conn, run_id=run_id), int(run["attempt"]),
            (int(a["attempt"]) for a in restarts)))
        scores = run_scores(conn, run_id, newest)
        if scores:
            nodes = repo.rank_node_names(conn, run_id=run_id)
            for rank, score in sorted(scores.items(), key=lambda kv: (kv[1], kv[0]))[
                    :STRAGGLER_TOP]:
                f.straggler.add_metric([name, str(rank), nodes.get(rank, "")], score)
        for ag in repo.run_agents(conn, run_id=run_id):
            f.hb_age.add_metric([name, ag["node"]], max(0.0, now - ag["last_seen_at"]))
            if ag["disk_free_bytes"] is not None:
                f.disk.add_metric([name, ag["node"]], ag["disk_free_bytes"])


# ---------------------------------------------------------------------------------------------
# request metrics (a pure ASGI middleware) and the /metrics route


class RequestMetrics:
    """Counts requests by method, route template and status; times the ingest route."""

    def __init__(self, app: Any, *, registry: CollectorRegistry) -> None:
        self.app = app
        self.requests = Counter("trainwarden_http_requests", "HTTP requests",
                                ["method", "route", "status"], registry=registry)
        self.ingest = Histogram("trainwarden_ingest_latency_seconds",
                                "Time to answer an ingest request", buckets=INGEST_BUCKETS,
                                registry=registry)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 500
        root = str(scope.get("root_path", ""))

        async def send_status(msg: dict[str, Any]) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = int(msg["status"])
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.requests.labels(scope.get("method", ""), route_template(scope, root),
                                 str(status)).inc()
            if scope.get("path") == INGEST_PATH:
                self.ingest.observe(time.perf_counter() - t0)


def route_template(scope: dict[str, Any], root_path: str = "") -> str:
    """The matched route's path template, router prefix included (bounded cardinality), or
    "unmatched".  The route object knows its template without the router's prefix; the prefix
    is what the request path has in front of the route's rendered template.  A mount (the
    static files) shows as its prefix + "/{path}" (the routing extended ``root_path``)."""
    route = scope.get("route")
    fmt = getattr(route, "path_format", None)
    if not isinstance(fmt, str):
        mounted = str(scope.get("root_path", ""))
        if mounted != root_path and mounted.startswith(root_path):
            return mounted[len(root_path):] + "/{path}"
        return "unmatched"
    params = scope.get("path_params") or {}
    rendered = fmt
    for k, v in params.items():
        rendered = rendered.replace("{" + str(k) + "}", str(v))
    path = str(scope.get("path", ""))
    if rendered and path.endswith(rendered):
        return path[: len(path) - len(rendered)] + fmt
    return fmt


def install(app: FastAPI, *, db: Database, clock: Clock, restart_budget: int,
            prefix: str = "") -> CollectorRegistry:
    """Add the request middleware and ``GET /metrics`` (read auth) to ``app``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(db, clock, restart_budget=restart_budget))
    app.add_middleware(RequestMetrics, registry=registry)
    router = APIRouter(tags=["metrics"])

    @router.get("/metrics", response_class=Response, include_in_schema=True)
    def metrics(_auth: ReadAuth) -> Response:
        """Prometheus text exposition (store gauges read at scrape time)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(router, prefix=prefix)
    app.state.metrics_registry = registry
    return registry

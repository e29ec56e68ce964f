"""Prometheus metrics: a collector that reads the store at scrape time, and the supervisor's
own request metrics.

The exported names and labels are a contract (``deploy/prometheus/alerts.yml`` and the
Grafana dashboard are written against them); change them only together.

Cardinality: per run a fixed set of series (7 incident kinds, 6 restart causes, 4 budgets),
per agent (node) six, per GPU four (at most ``GPUS_PER_NODE`` per node), and at most
``STRAGGLER_TOP`` rank series (the lowest straggler scores).  Only runs that are active, or
whose status changed in the last ``RECENT_S`` seconds, are exported.

Derived values: a restart's ``cause`` is the kind of the incident its action answers
(loss_spike/nonfinite -> "spike"), "operator" for an operator's action, "other" for anything
else; ``restarts_without_progress`` counts, from the newest ended attempt backwards, the
attempts started by a restart whose highest step did not pass the highest step of every
earlier attempt (the running attempt ends the streak once it passes, and is not counted
while it has not); ``restart_budget_remaining{cause}`` is each budget (crash, hang,
node_lost: the restart budget; spike: the rollback budget) less the automatic restarts
counted against it; ``mfu_ratio`` is throughput x declared FLOPs per sample (or token) /
(ranks x declared peak FLOP/s per rank), exported once the run declared them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from fastapi import APIRouter, FastAPI, Response
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector

from supervisor.api.deps import ReadAuth
from supervisor.enums import ACTIVE_STATUSES, Actor, IncidentKind, RestartCause
from supervisor.evaluator import Clock
from supervisor.policy import PolicyConfig
from supervisor.store import reads, registry, windows
from supervisor.store import recovery as rec
from supervisor.store.db import Connection, Database
from supervisor.store.rows import AgentRow, RunRow, StepAggregateRow, Throughput

RECENT_S = 24 * 3600.0
INCIDENT_KINDS = tuple(IncidentKind)
RESTART_CAUSES: tuple[str, ...] = (
    RestartCause.CRASH, RestartCause.HANG, RestartCause.SPIKE, RestartCause.OPERATOR,
    RestartCause.NODE_LOST, IncidentKind.COLLECTIVE_TIMEOUT)
# Incident kind -> restart cause label; anything else is "other".
_CAUSE_OF_KIND: dict[str, str] = {
    IncidentKind.CRASH: RestartCause.CRASH, IncidentKind.HANG: RestartCause.HANG,
    IncidentKind.LOSS_SPIKE: RestartCause.SPIKE, IncidentKind.NONFINITE: RestartCause.SPIKE,
    RestartCause.SPIKE: RestartCause.SPIKE, IncidentKind.NODE_LOST: RestartCause.NODE_LOST,
    IncidentKind.COLLECTIVE_TIMEOUT: IncidentKind.COLLECTIVE_TIMEOUT}
STRAGGLER_WINDOW = 20  # steps of per-rank timings behind a straggler score
STRAGGLER_TOP = 16  # rank series exported per run: the lowest scores
BUDGET_CAUSES = (RestartCause.CRASH, RestartCause.HANG, RestartCause.NODE_LOST,
                 RestartCause.SPIKE)
GPUS_PER_NODE = 16  # GPU series exported per node
INGEST_PATH = "/api/v1/ingest"
INGEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# ---------------------------------------------------------------------------------------------
# derived values (pure)


def restart_cause(action: Mapping[str, Any]) -> str:
    """The ``cause`` label of one restart action."""
    if action.get("actor") == Actor.OPERATOR:
        return RestartCause.OPERATOR
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


def straggler_scores(rows: Sequence[Mapping[str, Any]]) -> dict[int, float]:
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


def run_scores(conn: Connection, run_id: int, newest: StepAggregateRow | None
               ) -> dict[int, float]:
    """Straggler scores of the newest attempt's last ``STRAGGLER_WINDOW`` steps up to
    ``reads.delivered_step``: scored on newer steps, a rank would be compared with fewer peers,
    and the ranks behind would get no score at all."""
    if newest is None:
        return {}
    attempt = int(newest["attempt"])
    upto = reads.delivered_step(conn, run_id=run_id, attempt=attempt)
    if upto is None:
        return {}
    rows = windows.rank_phase_rows(conn, run_id=run_id, attempt=attempt,
                                step_from=upto - STRAGGLER_WINDOW + 1, step_to=upto)
    return straggler_scores(rows)


def mfu(declared: dict[str, Any] | None, throughput: Throughput) -> float | None:
    """Model FLOPs utilisation from a ``flops_declared`` event's details and
    ``reads.throughput``'s figures; None when not declared or not measurable yet."""
    factor = mfu_factor(declared, throughput["ranks"])
    if factor is None:
        return None
    rate = throughput["samples_per_s"] if factor[0] == "samples" else throughput["tokens_per_s"]
    return None if rate is None else rate * factor[1]


def mfu_factor(declared: dict[str, Any] | None, ranks: Any) -> tuple[str, float] | None:
    """(unit, factor): MFU = throughput in ``unit`` per second x factor."""
    if not declared or not isinstance(ranks, int) or ranks < 1:
        return None
    peak = declared.get("peak_flops_per_rank")
    if not isinstance(peak, int | float) or peak <= 0:
        return None
    for unit, key in (("samples", "flops_per_sample"), ("tokens", "flops_per_token")):
        flops = declared.get(key)
        if isinstance(flops, int | float) and flops > 0:
            return unit, float(flops) / (ranks * float(peak))
    return None


def budgets_left(restarts: Sequence[Mapping[str, Any]], *, restart_budget: int,
                 rollback_budget: int) -> dict[str, int]:
    """Per budget cause: what is left after the automatic restarts counted against it (as
    ``policy.budget_left`` counts them)."""
    used = dict.fromkeys(BUDGET_CAUSES, 0)
    for a in restarts:
        if a.get("actor") == Actor.POLICY:
            cause = a.get("cause") or RestartCause.CRASH
            used[cause] = used.get(cause, 0) + 1
    return {c: max(0, (rollback_budget if c == RestartCause.SPIKE else restart_budget) - used[c])
            for c in BUDGET_CAUSES}


def mean_loss(agg: Mapping[str, Any]) -> float | None:
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
                        "Automatic restarts left in each budget (spike: rollbacks)",
                        labels=["run", "cause"])
        self.mfu = g("trainwarden_run_mfu_ratio",
                     "Model FLOPs utilisation (declared FLOPs per sample and peak)",
                     labels=["run"])
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
        self.disk_ratio = g("trainwarden_agent_disk_free_ratio",
                            "Free share of the checkpoint root's file system",
                            labels=["run", "node"])
        self.cpu = g("trainwarden_agent_worker_cpu_percent",
                     "CPU of the node's workers, summed (100 = one core)", labels=["run", "node"])
        self.rss = g("trainwarden_agent_worker_rss_bytes",
                     "Resident memory of the node's workers, summed", labels=["run", "node"])
        self.gpu_ok = g("trainwarden_agent_gpu_available",
                        "1 when the agent reads its GPUs through NVML", labels=["run", "node"])
        gl = ["run", "node", "gpu"]
        self.gpu_util = g("trainwarden_gpu_utilization_percent", "GPU utilisation", labels=gl)
        self.gpu_mem = g("trainwarden_gpu_memory_used_bytes", "GPU memory in use", labels=gl)
        self.gpu_temp = g("trainwarden_gpu_temperature_celsius", "GPU temperature", labels=gl)
        self.gpu_ecc = g("trainwarden_gpu_ecc_uncorrected_errors",
                         "Uncorrected ECC errors since the driver loaded (volatile count)",
                         labels=gl)

    def all(self) -> list[Metric]:
        return [self.info, self.active, self.step, self.attempt, self.loss, self.throughput,
                self.since_step, self.ckpt_age, self.restarts, self.budget, self.mfu,
                self.incidents, self.no_progress, self.straggler, self.hb_age, self.disk,
                self.disk_ratio, self.cpu, self.rss, self.gpu_ok, self.gpu_util, self.gpu_mem,
                self.gpu_temp, self.gpu_ecc]


class StoreCollector(Collector):
    """Reads the store at scrape time (one read transaction per scrape)."""

    def __init__(self, db: Database, clock: Clock = time.time, *, restart_budget: int,
                 rollback_budget: int) -> None:
        self.db = db
        self.clock = clock
        self.restart_budget = restart_budget
        self.rollback_budget = rollback_budget

    def collect(self) -> Iterator[Metric]:
        f = _Families()
        now = self.clock()
        with self.db.read() as conn:
            for run in registry.runs_for_metrics(conn, since=now - RECENT_S):
                self._run(conn, f, run, now)
        yield from f.all()

    def _run(self, conn: Connection, f: _Families, run: RunRow, now: float) -> None:
        name, run_id = str(run["name"]), int(run["id"])
        f.info.add_metric([name, str(run["status"])], 1)
        f.active.add_metric([name], 1 if run["status"] in ACTIVE_STATUSES else 0)
        f.attempt.add_metric([name], run["attempt"])
        newest = reads.newest_step(conn, run_id=run_id)
        if newest is not None:
            f.step.add_metric([name], newest["step"])
            loss = mean_loss(newest)
            if loss is not None:
                f.loss.add_metric([name], loss)
            tp = reads.throughput(conn, run_id=run_id, attempt=int(newest["attempt"]))
            if tp["samples_per_s"] is not None:
                f.throughput.add_metric([name], tp["samples_per_s"])
            util = mfu(reads.flops_declaration(conn, run_id=run_id), tp)
            if util is not None:
                f.mfu.add_metric([name], util)
        f.since_step.add_metric(
            [name], max(0.0, now - (newest["t_last"] if newest else run["created_at"])))
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run_id)
        if ckpt is not None:
            f.ckpt_age.add_metric([name], max(0.0, now - ckpt["t"]))
        restarts = reads.restart_actions(conn, run_id=run_id)
        by_cause: dict[str, int] = dict.fromkeys(RESTART_CAUSES, 0)
        for a in restarts:
            cause = restart_cause(a)
            by_cause[cause] = by_cause.get(cause, 0) + 1
        for cause, n in by_cause.items():
            f.restarts.add_metric([name, cause], n)
        for cause, left in budgets_left(restarts, restart_budget=self.restart_budget,
                                        rollback_budget=self.rollback_budget).items():
            f.budget.add_metric([name, cause], left)
        counts = reads.open_incident_counts(conn, run_id=run_id)
        for kind in dict.fromkeys([*INCIDENT_KINDS, *counts]):
            f.incidents.add_metric([name, kind], counts.get(kind, 0))
        f.no_progress.add_metric([name], restarts_without_progress(
            rec.max_steps(conn, run_id=run_id), int(run["attempt"]),
            (int(a["attempt"]) for a in restarts)))
        scores = run_scores(conn, run_id, newest)
        if scores:
            nodes = windows.rank_nodes(conn, run_id=run_id)
            for rank, score in sorted(scores.items(), key=lambda kv: (kv[1], kv[0]))[
                    :STRAGGLER_TOP]:
                f.straggler.add_metric([name, str(rank), nodes.get(rank, "")], score)
        for ag in registry.run_agents(conn, run_id=run_id):
            self._agent(f, name, ag, now)

    @staticmethod
    def _agent(f: _Families, name: str, ag: AgentRow, now: float) -> None:
        node = str(ag["node"])
        f.hb_age.add_metric([name, node], max(0.0, now - ag["last_seen_at"]))
        free, total = ag["disk_free_bytes"], ag.get("disk_total_bytes")
        if free is not None:
            f.disk.add_metric([name, node], free)
            if total:
                f.disk_ratio.add_metric([name, node], free / total)
        workers = ag.get("workers")
        if isinstance(workers, list) and workers:
            f.cpu.add_metric([name, node], sum(float(w.get("cpu_percent") or 0.0)
                                               for w in workers))
            f.rss.add_metric([name, node], sum(float(w.get("rss_bytes") or 0) for w in workers))
        gpus = ag.get("gpus")
        if not isinstance(gpus, dict):
            return
        f.gpu_ok.add_metric([name, node], 1 if gpus.get("available") else 0)
        for d in (gpus.get("devices") or [])[:GPUS_PER_NODE]:
            if not isinstance(d, dict):
                continue
            labels = [name, node, str(d.get("index", ""))]
            for fam, key in ((f.gpu_util, "util_percent"), (f.gpu_mem, "mem_used_bytes"),
                             (f.gpu_temp, "temp_c"), (f.gpu_ecc, "ecc_uncorrected")):
                v = d.get(key)
                if isinstance(v, int | float) and not isinstance(v, bool):
                    fam.add_metric(labels, v)


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


def install(app: FastAPI, *, db: Database, clock: Clock, policy_cfg: PolicyConfig,
            prefix: str = "") -> CollectorRegistry:
    """Add the request middleware and ``GET /metrics`` (read auth) to ``app``; the budgets
    exported are the policy's."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(db, clock, restart_budget=policy_cfg.restart_budget,
                                     rollback_budget=policy_cfg.rollback_budget))
    app.add_middleware(RequestMetrics, registry=registry)
    router = APIRouter(tags=["metrics"])

    @router.get("/metrics", response_class=Response, include_in_schema=True)
    def metrics(_auth: ReadAuth) -> Response:
        """Prometheus text exposition (store gauges read at scrape time)."""
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(router, prefix=prefix)
    app.state.metrics_registry = registry
    return registry

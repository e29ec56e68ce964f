"""Prometheus metrics: a collector that reads the store at scrape time, and the supervisor's
own request metrics.

The exported names and labels are a contract (``deploy/prometheus/alerts.yml`` and the
Grafana dashboard are written against them); change them only together.

Cardinality: per run a fixed set of series (7 incident kinds, 6 restart causes, 4 budgets,
and once the run restarted a histogram of 14 series for each of the 6 restart phases),
per agent (node) six, per GPU four (at most ``GPUS_PER_NODE`` per node), and at most
``STRAGGLER_TOP`` rank series (the lowest straggler scores).  Only runs that are active, or
whose status changed in the last ``RECENT_S`` seconds, are exported.  Per node of the health
ledger (``store.hosts``: every node with evidence or a state change) two, whatever runs:
``host_cordoned`` (1 while cordoned: never chosen as a member; 0 healthy or on probation)
and ``host_probation`` (1 while on probation: uncordoned, waiting for a passed preflight).

Derived values, each computed once, in the pure place the supervisor's decisions use it:
``restarts{cause}`` is ``policy.restart_counts`` (every restart action of the run, its sum
over the causes the run's "restarts" of the API and the dashboard); a restart's ``cause`` is
the one the policy recorded on its action (``policy.restart_cause``: its budget; "operator"
for an operator's action); ``restart_budget_remaining{cause}`` is
``policy.budgets_left`` and ``restarts_without_progress`` is
``policy.restarts_without_progress``, the numbers the policy stops a run on, and
``restarts_without_progress_limit`` the setting it compares them with; the straggler
``score`` and ``slow`` of a rank are ``detect.straggler.straggler_scores`` over the steps every
rank has delivered, and ``straggler_threshold`` the detector's threshold (see
``deploy/prometheus/alerts.yml``); ``mfu_ratio`` is ``goodput.mfu.mfu``: throughput x declared
FLOPs per sample (or token) / (ranks x declared peak FLOP/s per rank), exported once the run
declared them; ``restart_phase_seconds{phase}`` counts the known phases of
``efficiency.restart_anatomies``, the seconds each restart action shows in the API.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.control import actions, detection, policy
from trainwarden.supervisor.detect.node_lost import NodeLostConfig
from trainwarden.supervisor.detect.straggler import StragglerConfig
from trainwarden.supervisor.enums import ACTIVE_STATUSES, Actor, HostState, IncidentKind
from trainwarden.supervisor.goodput.anatomy import PHASE_BUCKETS_S, PHASES
from trainwarden.supervisor.goodput.mfu import mfu
from trainwarden.supervisor.observability import efficiency
from trainwarden.supervisor.store import hosts, reads, registry, windows
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection, Database
from trainwarden.supervisor.store.health import workers_total
from trainwarden.supervisor.store.rows import AgentRow, RunRow

RECENT_S = 24 * 3600.0
INCIDENT_KINDS = tuple(IncidentKind)
RESTART_CAUSES = policy.RESTART_CAUSES
STRAGGLER_TOP = 16  # rank series exported per run: the lowest scores
GPUS_PER_NODE = 16  # GPU series exported per node
INGEST_PATH = "/api/v1/ingest"
INGEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


# ---------------------------------------------------------------------------------------------
# derived values (computed by the pure functions named above)


def phase_buckets(xs: Sequence[float]) -> list[tuple[str, float]]:
    """Cumulative (le, count) buckets of ``PHASE_BUCKETS_S`` and +Inf over ``xs``."""
    # (floatToGoString: prometheus_client.utils is not annotated)
    out = [(floatToGoString(le), float(sum(1 for x in xs if x <= le)))  # type: ignore[no-untyped-call]
           for le in PHASE_BUCKETS_S]
    return [*out, ("+Inf", float(len(xs)))]


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
        self.step = g("trainwarden_run_step", "Newest step of the final lineage",
                      labels=["run"])
        self.attempt = g("trainwarden_run_attempt", "Current attempt", labels=["run"])
        self.loss = g("trainwarden_run_loss",
                      "Mean loss of the final lineage's newest step (NaN when non-finite)",
                      labels=["run"])
        self.throughput = g("trainwarden_run_throughput_samples_per_second",
                            "Samples per second over the newest steps", labels=["run"])
        self.since_step = g("trainwarden_run_seconds_since_last_step",
                            "Seconds since the newest step report (since creation before one)",
                            labels=["run"])
        self.ckpt_age = g("trainwarden_run_checkpoint_age_seconds",
                          "Age of the newest complete checkpoint", labels=["run"])
        self.ckpt_age_steps = g("trainwarden_run_checkpoint_age_steps",
                                "Steps trained since the newest complete checkpoint (what a "
                                "failure now would redo)", labels=["run"])
        self.ckpt_failed = g("trainwarden_run_checkpoint_failed_saves",
                             "Checkpoint saves failed since the newest complete checkpoint "
                             "(a full, read-only or vanished disk; training goes on)",
                             labels=["run"])
        self.restarts = CounterMetricFamily("trainwarden_run_restarts",
                                            "Restarts by cause", labels=["run", "cause"])
        self.budget = g("trainwarden_run_restart_budget_remaining",
                        "Automatic restarts left in each budget (spike: rollbacks)",
                        labels=["run", "cause"])
        self.mfu = g("trainwarden_run_mfu_ratio",
                     "Model FLOPs utilisation (declared FLOPs per sample and peak)",
                     labels=["run"])
        self.goodput = g("trainwarden_run_goodput_ratio",
                         "ETTR: productive step time on the final lineage / wall time since "
                         "the run started", labels=["run"])
        self.productive = g("trainwarden_run_productive_seconds",
                            "Productive step time on the final lineage since the run "
                            "started (ETTR's numerator; it drops when a restore throws "
                            "steps away)", labels=["run"])
        self.wall = g("trainwarden_run_wall_seconds",
                      "Wall time since the run started (ETTR's denominator; it stops when "
                      "the run ends)", labels=["run"])
        self.badput = g("trainwarden_run_badput_seconds",
                        "Wall time since the run started not spent on productive steps, by "
                        "cause (causes not measured are left out)", labels=["run", "cause"])
        self.restart_phase = HistogramMetricFamily(
            "trainwarden_restart_phase_seconds",
            "Seconds per phase of the run's restarts (decided -> workers stopped -> torchrun "
            "started -> rendezvous done -> checkpoint loaded -> first step; phase total: "
            "decided -> first step), over its restart actions whose phase is known",
            labels=["run", "phase"])
        self.incidents = g("trainwarden_run_open_incidents", "Open incidents by kind",
                           labels=["run", "kind"])
        self.spares = g("trainwarden_run_spares",
                        "Free spares of the run: heard from within the node-lost deadline, "
                        "not cordoned", labels=["run"])
        self.spares_configured = g("trainwarden_run_spares_configured",
                                   "1 when a node registered into the run as a spare",
                                   labels=["run"])
        self.nodes_missing = g("trainwarden_run_nodes_missing",
                               "Node ranks with no node fit to run and no spare to take "
                               "them (the run stands by for them)", labels=["run"])
        self.membership_epoch = g("trainwarden_run_membership_epoch",
                                  "Membership epoch: it grows each time spares take node "
                                  "ranks", labels=["run"])
        self.world_nodes = g("trainwarden_run_world_nodes",
                             "Nodes the current attempt runs on (fewer than "
                             "trainwarden_run_declared_nodes while the run is shrunk)",
                             labels=["run"])
        self.declared_nodes = g("trainwarden_run_declared_nodes",
                                "Nodes the run's torchrun command declares (--nnodes)",
                                labels=["run"])
        self.judge_failures = CounterMetricFamily(
            "trainwarden_evaluator_run_failures",
            "Evaluator ticks that failed to judge the run (each retried on the next tick; "
            "other runs are judged as usual), since this supervisor started",
            labels=["run"])
        self.no_progress = g("trainwarden_run_restarts_without_progress",
                             "Automatic restarts in a row since which the run has not passed "
                             "its highest step", labels=["run"])
        self.no_progress_limit = g("trainwarden_run_restarts_without_progress_limit",
                                   "Restarts without progress after which the supervisor "
                                   "stops the run at the next failure", labels=["run"])
        self.straggler = g("trainwarden_rank_straggler_score",
                           "Median of the other ranks' pre-collective time / this rank's over "
                           f"the detector's window (the {STRAGGLER_TOP} lowest per run)",
                           labels=["run", "rank", "node"])
        self.straggler_slow = g("trainwarden_rank_straggler_slow",
                                "1 when the straggler detector's rule holds for the rank on "
                                "the window (score below the threshold, slower by at least "
                                "the minimum)", labels=["run", "rank", "node"])
        self.straggler_threshold = g("trainwarden_run_straggler_threshold",
                                     "The straggler detector's score threshold",
                                     labels=["run"])
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
        self.host_cordoned = g("trainwarden_host_cordoned",
                               "1 while the node is cordoned (never chosen as a member), "
                               "0 when healthy or on probation", labels=["node"])
        self.host_probation = g("trainwarden_host_probation",
                                "1 while the node is on probation (uncordoned, healthy again "
                                "once it passes a preflight), else 0", labels=["node"])

    def all(self) -> list[Metric]:
        return [self.info, self.active, self.step, self.attempt, self.loss, self.throughput,
                self.since_step, self.ckpt_age, self.ckpt_age_steps, self.ckpt_failed,
                self.restarts, self.budget, self.mfu,
                self.goodput, self.productive, self.wall, self.badput, self.restart_phase,
                self.incidents, self.spares, self.spares_configured, self.nodes_missing,
                self.membership_epoch, self.world_nodes, self.declared_nodes,
                self.judge_failures, self.no_progress,
                self.no_progress_limit,
                self.straggler, self.straggler_slow, self.straggler_threshold, self.hb_age,
                self.disk, self.disk_ratio, self.cpu, self.rss, self.gpu_ok, self.gpu_util,
                self.gpu_mem, self.gpu_temp, self.gpu_ecc, self.host_cordoned,
                self.host_probation]


class StoreCollector(Collector):
    """Reads the store at scrape time (one read transaction per scrape)."""

    def __init__(self, db: Database, clock: Clock = time.time, *,
                 policy_cfg: policy.PolicyConfig | None = None,
                 straggler: StragglerConfig | None = None,
                 goodput: Callable[[int], dict[str, Any] | None] | None = None,
                 judge_failures: Mapping[int, int] | None = None,
                 live_s: float = NodeLostConfig().deadline_s) -> None:
        self.db = db
        self.live_s = live_s  # the node-lost deadline: a node heard from within it is live
        self.judge_failures = judge_failures  # run id -> failed ticks (Evaluator.run_failures)
        self.goodput = goodput  # run id -> the evaluator's live ETTR (Evaluator.goodput)
        self.clock = clock
        self.policy_cfg = policy_cfg or policy.PolicyConfig()
        self.straggler_cfg = straggler or StragglerConfig()

    def collect(self) -> Iterator[Metric]:
        f = _Families()
        now = self.clock()
        with self.db.read() as conn:
            for run in registry.runs_for_metrics(conn, since=now - RECENT_S):
                self._run(conn, f, run, now)
            for node, h in hosts.host_states(conn).items():
                f.host_cordoned.add_metric([node], 1 if h["state"] == HostState.CORDONED else 0)
                f.host_probation.add_metric([node],
                                            1 if h["state"] == HostState.PROBATION else 0)
        yield from f.all()

    def _run(self, conn: Connection, f: _Families, run: RunRow, now: float) -> None:
        name, run_id = str(run["name"]), int(run["id"])
        f.info.add_metric([name, str(run["status"])], 1)
        f.active.add_metric([name], 1 if run["status"] in ACTIVE_STATUSES else 0)
        f.attempt.add_metric([name], run["attempt"])
        if self.judge_failures is not None:
            f.judge_failures.add_metric([name], self.judge_failures.get(run_id, 0))
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
        last = reads.newest_report_time(conn, run_id=run_id)
        f.since_step.add_metric([name], max(0.0, now - (last if last is not None
                                                        else run["created_at"])))
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run_id)
        if ckpt is not None:
            f.ckpt_age.add_metric([name], max(0.0, now - ckpt["t"]))
            if newest is not None:  # (step N is the (N+1)th step; step_N holds N steps)
                f.ckpt_age_steps.add_metric([name], max(0, int(newest["step"]) + 1
                                                        - int(ckpt["step"])))
        f.ckpt_failed.add_metric([name], rec.failed_saves_since(
            conn, run_id=run_id, t=float(ckpt["t"]) if ckpt is not None else None))
        history = rec.restart_history(conn, run_id=run_id)
        restarts = policy.restart_counts(history)
        for cause, n in restarts.by_cause.items():
            f.restarts.add_metric([name, cause], n)
        for cause, left in policy.budgets_left(restarts.automatic, self.policy_cfg).items():
            f.budget.add_metric([name, cause], left)
        gp = self.goodput(run_id) if self.goodput is not None else None
        if gp is not None:
            if gp["ettr"] is not None:
                f.goodput.add_metric([name], gp["ettr"])
            f.productive.add_metric([name], gp["productive_s"])
            f.wall.add_metric([name], gp["wall_s"])
            for cause, secs in gp["badput_s"].items():
                if secs is not None:
                    f.badput.add_metric([name, cause], secs)
        self._restart_phases(conn, f, name, run_id)
        cap = actions.capacity(conn, run_id=run_id, now=now, live_s=self.live_s)
        f.spares.add_metric([name], cap.spares)
        f.spares_configured.add_metric([name], 1 if cap.spares_configured else 0)
        f.nodes_missing.add_metric([name], cap.waiting)
        f.membership_epoch.add_metric([name], cap.epoch)
        if cap.nnodes is not None:
            f.declared_nodes.add_metric([name], cap.nnodes)
            f.world_nodes.add_metric([name], cap.world or cap.nnodes)
        counts = reads.open_incident_counts(conn, run_id=run_id)
        for kind in dict.fromkeys([*INCIDENT_KINDS, *counts]):
            f.incidents.add_metric([name, kind], counts.get(kind, 0))
        f.no_progress.add_metric([name], policy.restarts_without_progress(
            [h["high_step"] for h in history if h["actor"] == Actor.POLICY],
            max(rec.max_steps(conn, run_id=run_id).values(), default=None)))
        f.no_progress_limit.add_metric([name], self.policy_cfg.no_progress_restarts)
        f.straggler_threshold.add_metric([name], self.straggler_cfg.threshold)
        scores = detection.run_scores(conn, run_id, newest, self.straggler_cfg)
        if scores:
            nodes = windows.rank_nodes(conn, run_id=run_id)
            for sc in sorted(scores.values(), key=lambda v: (v.score, v.rank))[:STRAGGLER_TOP]:
                labels = [name, str(sc.rank), nodes.get(sc.rank, "")]
                f.straggler.add_metric(labels, sc.score)
                f.straggler_slow.add_metric(labels, 1 if sc.slow else 0)
        for ag in registry.run_agents(conn, run_id=run_id):
            self._agent(f, name, ag, now)

    @staticmethod
    def _restart_phases(conn: Connection, f: _Families, name: str, run_id: int) -> None:
        """One histogram per phase over the run's restarts (``efficiency.restart_anatomies``:
        the same seconds as each action's ``anatomy`` in the API); unknown phases are left
        out, never counted as 0."""
        seen: dict[str, list[float]] = {p: [] for p in (*PHASES, "total")}
        for an in efficiency.restart_anatomies(conn, run_id).values():
            for phase, secs in (*an.phases.items(), ("total", an.total_s)):
                if secs is not None:
                    seen[phase].append(secs)
        for phase, xs in seen.items():
            if xs:
                f.restart_phase.add_metric([name, phase], buckets=phase_buckets(xs),
                                           sum_value=sum(xs))

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
            for family, key in ((f.cpu, "cpu_percent"), (f.rss, "rss_bytes")):
                if (summed := workers_total(workers, key)) is not None:
                    family.add_metric([name, node], summed)
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


class RequestCounters:
    """The request counter (by method, route template and status) and the ingest latency
    histogram, shared by ``RequestMetrics`` and the ingest route's own path
    (``trainwarden.supervisor.server.ingest_path``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("trainwarden_http_requests", "HTTP requests",
                                ["method", "route", "status"], registry=registry)
        self.ingest = Histogram("trainwarden_ingest_latency_seconds",
                                "Time to answer an ingest request", buckets=INGEST_BUCKETS,
                                registry=registry)
        self._children: dict[tuple[str, str, int], Any] = {}

    def count(self, method: str, route: str, status: int) -> None:
        key = (method, route, status)
        child = self._children.get(key)
        if child is None:
            child = self.requests.labels(method, route, str(status))
            if len(self._children) < 10_000:  # (route templates: a bounded set)
                self._children[key] = child
        child.inc()

    def ingest_latency(self, seconds: float) -> None:
        self.ingest.observe(seconds)


class RequestMetrics:
    """Counts requests by method, route template and status; times the ingest route."""

    def __init__(self, app: Any, *, counters: RequestCounters) -> None:
        self.app = app
        self.counters = counters

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
            self.counters.count(scope.get("method", ""), route_template(scope, root), status)
            if scope.get("path") == INGEST_PATH:
                self.counters.ingest_latency(time.perf_counter() - t0)


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


class OverloadCollector(Collector):
    """Whether the supervisor is behind (the evaluator's verdict of its last tick) and how
    late batches arrive (``trainwarden.supervisor.ingest.delivery``): in memory, no store read."""

    def __init__(self, state: Callable[[], tuple[bool, float | None]]) -> None:
        self.state = state  # () -> (overloaded, lateness at the configured quantile)

    def collect(self) -> Iterator[Metric]:
        overloaded, lateness = self.state()
        g = GaugeMetricFamily(
            "trainwarden_supervisor_overloaded",
            "1 while the supervisor is behind (its hang, node-lost and straggler verdicts "
            "are held back), else 0")
        g.add_metric([], 1 if overloaded else 0)
        yield g
        late = GaugeMetricFamily(
            "trainwarden_ingest_lateness_seconds",
            "How much later than each agent's usual its batches arrived over the last "
            "seconds (the overload detector's quantile; 0 with no recent batch)")
        late.add_metric([], lateness or 0.0)
        yield late


class FleetCollector(Collector):
    """The fleet's standing (``control.fleet_sync.FleetStatus``): in memory, no store read."""

    def __init__(self, status: Callable[[], Any]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        st = self.status()
        ok = GaugeMetricFamily(
            "trainwarden_fleet_ok",
            "1 while the supervisor may drain and resume nodes in the fleet's scheduler (its "
            "check at start and its last command succeeded), 0 when it may not", labels=["backend"])
        ok.add_metric([st.backend], 0 if st.ok is False else 1)
        yield ok
        failures = CounterMetricFamily(
            "trainwarden_fleet_command_failures",
            "Scheduler commands (reads, drains, resumes) that failed", labels=["backend"])
        failures.add_metric([st.backend], st.command_failures)
        yield failures


class LeaderCollector(Collector):
    """Whether this replica runs the evaluator (``leader.Leadership.status``): one series
    per replica, so the replicas' scrapes together show which one leads."""

    def __init__(self, status: Callable[[], Mapping[str, Any]]) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        lead = GaugeMetricFamily("trainwarden_evaluator_leader",
                                 "1 while this replica holds the evaluator lease and runs the "
                                 "evaluator (always 1 on SQLite)", labels=["replica"])
        lead.add_metric([str(s["replica"])], 1 if s["leader"] else 0)
        epoch = GaugeMetricFamily("trainwarden_evaluator_lease_epoch",
                                  "The lease epoch this replica leads under (absent on a "
                                  "standby)", labels=["replica"])
        if s["epoch"] is not None:
            epoch.add_metric([str(s["replica"])], float(s["epoch"]))
        yield lead
        yield epoch


def install(app: FastAPI, *, db: Database, clock: Clock, policy_cfg: policy.PolicyConfig,
            straggler: StragglerConfig,
            goodput: Callable[[int], dict[str, Any] | None] | None = None,
            judge_failures: Mapping[int, int] | None = None,
            live_s: float = NodeLostConfig().deadline_s,
            overload: Callable[[], tuple[bool, float | None]] | None = None,
            leader: Callable[[], Mapping[str, Any]] | None = None,
            fleet: Callable[[], Any] | None = None,
            ) -> CollectorRegistry:
    """Add the request middleware to ``app`` and keep the registry ``GET /metrics``
    (``trainwarden.supervisor.api.metrics``) exposes in ``app.state.metrics_registry``; the
    policy's and the straggler detector's configuration are the ones the evaluator decides
    with."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(db, clock, policy_cfg=policy_cfg, straggler=straggler,
                                     goodput=goodput, judge_failures=judge_failures,
                                     live_s=live_s))
    if overload is not None:
        registry.register(OverloadCollector(overload))
    if leader is not None:
        registry.register(LeaderCollector(leader))
    if fleet is not None:
        registry.register(FleetCollector(fleet))
    counters = RequestCounters(registry)
    app.add_middleware(RequestMetrics, counters=counters)
    app.state.request_counters = counters
    app.state.metrics_registry = registry
    return registry

"""Observation: read windows of measurements from the store into the detectors' inputs.

No decisions here (that is ``policy``) and no statistics (that is ``detect``): this module only
knows which rows each detector needs and how to shape them.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trainwarden.agent.core.findings import FindingKind
from trainwarden.agent.core.states import LIVE_AGENT_STATES
from trainwarden.agent.protocol import WorkerEventName
from trainwarden.supervisor.detect import (
    Finding,
    HangConfig,
    LossSample,
    LossSpikeConfig,
    NodeLostConfig,
    ProgressWindow,
    RankProgress,
    RankScore,
    StragglerConfig,
    ThroughputConfig,
    ThroughputPoint,
    add_pre_collective,
    detect_hang,
    detect_loss,
    detect_lost_nodes,
    detect_stragglers,
    detect_throughput_decay,
    intervals_from_times,
    pre_collective_table,
    straggler_scores,
)
from trainwarden.supervisor.detect.disk import DiskConfig, detect_disk
from trainwarden.supervisor.detect.overload import OverloadConfig
from trainwarden.supervisor.detect.straggler import after_warmup
from trainwarden.supervisor.enums import ActionStatus
from trainwarden.supervisor.goodput.anatomy import anatomy
from trainwarden.supervisor.goodput.spike_cost import progress_lost
from trainwarden.supervisor.store import efficiency, hosts, reads, windows
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import AgentLiveness, LossRow, RunRow, StepAggregateRow

# An agent sends a batch at least every second; its newest batch tells us up to when we
# know what its workers did.
_DELIVERY_SLACK_S = 1.0

# The dashboard's per-rank phase-time chart shows at most this many newest steps.
RANK_CHART_MAX_STEPS = 300


@dataclass(frozen=True)
class DetectionConfig:
    hang: HangConfig = field(default_factory=HangConfig)
    node_lost: NodeLostConfig = field(default_factory=NodeLostConfig)
    straggler: StragglerConfig = field(default_factory=StragglerConfig)
    loss: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    throughput: ThroughputConfig = field(default_factory=lambda: ThroughputConfig(
        unit="samples/s"))
    disk: DiskConfig = field(default_factory=DiskConfig)
    overload: OverloadConfig = field(default_factory=OverloadConfig)
    straggler_table_steps: int = 100  # newest steps of per-rank timings read each time
    # Judging stragglers costs ranks x steps, and at thousands of ranks it competes with
    # ingest for the process: it runs at most every straggler_interval_s and never more
    # often than 25 times its own last duration (at most ~4% of a core), so a small run is
    # judged every tick and one of thousands of ranks every second or two.
    straggler_interval_s: float = 0.0  # seconds between two straggler judgements, at least
    straggler_cost_factor: float = 25.0  # x the last judgement's duration, at least
    interval_history: int = 300  # step intervals the hang deadline learns from


def attempt_started_at(conn: Connection, run: RunRow) -> float | None:
    """When the run's current attempt was launched (None while a restart is still pending:
    not every agent has relaunched yet)."""
    if int(run["attempt"]) == 0:
        return float(run["created_at"])
    action = rec.restart_action_for(conn, run_id=run["id"], attempt=run["attempt"])
    if action is None:
        return float(run["updated_at"])
    progress = action.get("progress") or {}
    t = progress.get(ActionStatus.RESTARTED) or progress.get(ActionStatus.RESUMED)
    return None if t is None else float(t)


def progress_window(conn: Connection, run: RunRow, *, started_at: float,
                    observing_since: float, cfg: DetectionConfig,
                    every_rank: bool = True) -> ProgressWindow:
    """``every_rank=False``: only the ranks that can change the verdict short of a hang
    (``windows.rank_progress_lagging``); a hang's finding names every rank behind, so it is
    judged again on the whole window."""
    run_id, attempt = int(run["id"]), int(run["attempt"])
    ranks = windows.rank_progress(conn, run_id=run_id, attempt=attempt) if every_rank else \
        windows.rank_progress_lagging(conn, run_id=run_id, attempt=attempt,
                                      lag_steps=cfg.hang.rank_lag_steps)
    times = windows.step_times(conn, run_id=run_id, attempt=attempt, limit=cfg.interval_history)
    if len(times) < cfg.hang.min_intervals + 1 and attempt > 0:  # learn from the last attempt
        times = windows.step_times(conn, run_id=run_id, attempt=attempt - 1,
                                limit=cfg.interval_history) + times
    ckpt_started = windows.latest_event(conn, run_id=run_id, attempt=attempt,
                                     name=WorkerEventName.CHECKPOINT_STARTED)
    newest_ckpt = windows.newest_checkpoint_time(conn, run_id=run_id)
    finished = windows.latest_event(conn, run_id=run_id, attempt=attempt,
                                    name=WorkerEventName.FINISHED)
    checkpoint_since = None
    if ckpt_started is not None and (newest_ckpt is None or newest_ckpt < ckpt_started["t"]):
        checkpoint_since = float(ckpt_started["t"])
    return ProgressWindow(
        attempt_started_at=started_at,
        ranks={int(r["rank"]): RankProgress(int(r["step"]), float(r["t"])) for r in ranks},
        steps_in_attempt=windows.count_steps(conn, run_id=run_id, attempt=attempt),
        step_intervals=intervals_from_times([t for _, t in times]),
        checkpoint_since=checkpoint_since,
        recent_save_s=windows.recent_save_seconds(conn, run_id=run_id),
        observing_since=observing_since,
        nodes={int(r["rank"]): str(r["node"]) for r in ranks},
        finished_at=None if finished is None else float(finished["t"]),
    )


def hang_findings(conn: Connection, run: RunRow, *, now: float,
                  observing_since: float, cfg: DetectionConfig,
                  agents: list[AgentLiveness] | None = None,
                  started: float | None = None,
                  batch_interval_s: float | None = None) -> list[Finding]:
    """``started``: the attempt's launch time when the caller has it (else it is read);
    ``batch_interval_s``: how often agents were told to send (None: their own, ~1 s)."""
    if started is None:
        started = attempt_started_at(conn, run)
    if started is None:
        return []
    w = progress_window(conn, run, started_at=started, observing_since=observing_since, cfg=cfg,
                        every_rank=False)
    # Judge progress only up to what every agent has delivered: reports reach us through
    # the agents, and a batch that is late (a slow network, a busy supervisor) is a delivery
    # gap, not a hang.  An agent that stays silent is the node-lost detector's business.
    if agents is None:
        agents = windows.agent_liveness(conn, run_id=run["id"])
    seen = [float(a["last_seen_at"]) for a in agents if a["state"] in LIVE_AGENT_STATES]
    if seen:
        now = min(now, min(seen) + max(_DELIVERY_SLACK_S, batch_interval_s or 0.0))
    out = detect_hang(w, now, cfg.hang)
    if any(f.kind == FindingKind.HANG for f in out):
        w = progress_window(conn, run, started_at=started, observing_since=observing_since,
                            cfg=cfg)
        out = detect_hang(w, now, cfg.hang)
    if w.ranks:  # a hang is "after the newest step any rank reported"
        newest = max(p.step for p in w.ranks.values())
        out = [dataclasses.replace(f, step=newest) if f.kind == FindingKind.HANG and f.step is None
               else f for f in out]
    return out


# A node told to batch every N s is lost only after this many of its batches went missing
# (and never sooner than the configured deadline).
LOST_AFTER_BATCHES = 3


def lost_node_findings(conn: Connection, run: RunRow, *, now: float,
                       observing_since: float, cfg: DetectionConfig,
                       agents: list[AgentLiveness] | None = None,
                       batch_interval_s: float | None = None) -> list[Finding]:
    if agents is None:
        agents = windows.agent_liveness(conn, run_id=run["id"])
    beats = {str(a["node"]): float(a["last_seen_at"]) for a in agents
             if a["state"] in LIVE_AGENT_STATES}
    down = hosts.fleet_down(conn) if beats else {}
    return detect_lost_nodes(beats, now, lost_deadline(cfg, batch_interval_s),
                             observing_since=observing_since, down=down)


def lost_deadline(cfg: DetectionConfig, batch_interval_s: float | None) -> NodeLostConfig:
    """The node-lost deadline at the batch interval the agents were asked for (never
    shorter than ``LOST_AFTER_BATCHES`` of their batches)."""
    lost = cfg.node_lost
    if batch_interval_s is not None and LOST_AFTER_BATCHES * batch_interval_s > lost.deadline_s:
        lost = dataclasses.replace(lost, deadline_s=LOST_AFTER_BATCHES * batch_interval_s)
    if batch_interval_s is not None and LOST_AFTER_BATCHES * batch_interval_s > lost.confirm_s:
        lost = dataclasses.replace(lost, confirm_s=LOST_AFTER_BATCHES * batch_interval_s)
    return lost


class PhaseWindow:
    """The newest ``steps`` steps of one run attempt's per-rank pre-collective times, kept
    between ticks and read incrementally: the first read takes the window by step, each later
    one only the rows stored since (by row id).  For a big run that is thousands of rows a
    tick instead of ranks x steps."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.attempt: int | None = None
        self.after_id = 0
        self.table: dict[int, dict[int, float]] = {}
        self.first_step: int | None = None  # the attempt's first step (its warm-up's start)

    def refresh(self, conn: Connection, run_id: int, attempt: int) -> dict[int, dict[int, float]]:
        if attempt != self.attempt:
            self.attempt, self.table, self.first_step = attempt, {}, None
            # The id first: a row stored after it is read by the next refresh, not lost.
            self.after_id = windows.max_rank_step_id(conn)
            span = windows.step_range(conn, run_id=run_id, attempt=attempt)
            if span is not None:
                self.first_step = span[0]
                lo = max(span[0], span[1] - self.steps + 1)
                self.table = pre_collective_table(windows.rank_phase_rows(
                    conn, run_id=run_id, attempt=attempt, step_from=lo))
        else:
            rows = windows.rank_phase_rows_after(conn, run_id=run_id, attempt=attempt,
                                              after_id=self.after_id)
            if rows:
                self.after_id = rows[-1][0]
            for _, step, rank, d, c in rows:
                add_pre_collective(self.table, step, rank, d, c)
                if self.first_step is None or step < self.first_step:
                    self.first_step = step
        if self.table:
            newest = max(self.table)
            for s in [s for s in self.table if s <= newest - self.steps]:
                del self.table[s]
        return self.table


def straggler_findings(conn: Connection, run: RunRow, *, cfg: DetectionConfig,
                       open_ranks: set[int], window: PhaseWindow | None = None
                       ) -> list[Finding]:
    run_id, attempt = int(run["id"]), int(run["attempt"])
    window = window or PhaseWindow(cfg.straggler_table_steps)
    table = window.refresh(conn, run_id, attempt)
    newest: dict[int, int] = {}  # rank -> the newest step it has delivered
    for s, row in table.items():
        for r in row:
            if s > newest.get(r, -1):
                newest[r] = s
    if len(newest) < 2:
        return []  # one rank has no peers; its own history alone is throughput's business
    # Judge only the steps every rank has delivered: ranks report through their own sockets
    # and batches, so the newest steps often hold one rank only, and the detector would
    # compare that rank with its own past instead of with its peers.
    upto = min(newest.values())
    if upto < max(newest.values()):
        table = {s: row for s, row in table.items() if s <= upto}
    table = after_warmup(table, window.first_step, cfg.straggler)
    return detect_stragglers(table, cfg=cfg.straggler,
                             nodes=windows.rank_nodes(conn, run_id=run_id),
                             flagged_ranks=open_ranks)


def run_scores(conn: Connection, run_id: int, newest: StepAggregateRow | None,
               cfg: StragglerConfig) -> dict[int, RankScore]:
    """Straggler scores (``straggler_scores``, the detector's own statistic) of the newest
    attempt over the detector's window ending at ``reads.delivered_step``, as the detector
    judges them: scored on newer steps, a rank would be compared with fewer peers, and the
    ranks behind would get no score at all.  ``newest``: ``reads.newest_step``."""
    if newest is None:
        return {}
    attempt = int(newest["attempt"])
    upto = reads.delivered_step(conn, run_id=run_id, attempt=attempt)
    if upto is None:
        return {}
    span = windows.step_range(conn, run_id=run_id, attempt=attempt)
    rows = windows.rank_phase_rows(conn, run_id=run_id, attempt=attempt,
                                step_from=upto - cfg.window_steps + 1, step_to=upto)
    return straggler_scores(after_warmup(pre_collective_table(rows),
                                         span[0] if span else None, cfg), cfg)


def rank_rows(conn: Connection, run_id: int, newest: StepAggregateRow | None,
              straggler: StragglerConfig) -> list[dict[str, Any]]:
    """Each rank's latest report with its straggler ``score`` and ``slow`` (the detector's
    rule on its window; both None for a rank without a score), lowest score first: what the
    dashboard's ranks table and the API's ``/runs/{run}/ranks`` show."""
    scores = run_scores(conn, run_id, newest, straggler)
    ranks = reads.rank_latest(conn, run_id=run_id)
    for r in ranks:
        sc = scores.get(int(r["rank"]))
        r["score"] = None if sc is None else sc.score
        r["slow"] = None if sc is None else sc.slow
    ranks.sort(key=lambda r: (r["score"] if r["score"] is not None else 9e9, r["rank"]))
    return ranks


# Most steps read beyond the detector's window when many arrived since the last look.
_LOSS_CATCH_UP_MAX = 20_000


def loss_rows(conn: Connection, run: RunRow, *, cfg: DetectionConfig,
              seen_step: int | None = None) -> list[LossRow]:
    """The loss window: the detector's lookback, plus every step stored since ``seen_step``
    (the newest step the previous look saw).  A fast run delivers a second of steps in one
    batch; with a fixed window the steps before a spike that came in one such burst would
    have slid out, and the detector would judge the spike against a baseline it polluted
    (placing its start a few steps late)."""
    limit = cfg.loss.lookback_steps + cfg.loss.window_steps
    if seen_step is not None:
        span = windows.step_range(conn, run_id=run["id"], attempt=run["attempt"])
        if span is not None:
            limit += min(_LOSS_CATCH_UP_MAX, max(0, span[1] - seen_step))
    return windows.loss_series(conn, run_id=run["id"], attempt=run["attempt"], limit=limit)


def loss_findings(rows: list[LossRow], *, cfg: DetectionConfig) -> list[Finding]:
    samples = []
    for r in rows:
        loss = math.nan if r["loss_nonfinite"] else r["loss"]
        grad = math.nan if r["grad_norm_nonfinite"] else None
        samples.append(LossSample(step=int(r["step"]), loss=loss, grad_norm=grad,
                                  t=float(r["t_last"])))
    return detect_loss(samples, cfg.loss)


def restart_seconds(conn: Connection, run: RunRow) -> float | None:
    """The run's measured restart time: the median, over its restarts whose anatomy is
    complete, of the seconds from the decision to the first step; None before any."""
    totals = [a.total_s for m in efficiency.restart_milestones(conn, run_id=run["id"]).values()
              if (a := anatomy(m)).total_s is not None]
    return statistics.median(totals) if totals else None


def with_spike_cost(findings: list[Finding], rows: list[LossRow],
                    restart_s: Callable[[], float | None]) -> list[Finding]:
    """Each loss-spike finding (incident or transient event) with what it cost so far in
    ``details["progress_lost"]`` (``goodput.spike_cost.progress_lost`` over the loss window,
    the step time measured over it) and the run's measured restart time in
    ``details["restart_s"]`` (None: none measured yet); the policy weighs them against a
    rollback."""
    kinds = (FindingKind.LOSS_SPIKE, FindingKind.LOSS_SPIKE_TRANSIENT)
    if not any(f.kind in kinds for f in findings):
        return findings
    history = [(int(r["step"]), float(r["loss"])) for r in rows
               if not r["loss_nonfinite"] and r["loss"] is not None]
    ts = [(int(r["step"]), float(r["t_last"])) for r in rows]
    gaps = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(ts)
            if s1 > s0 and t1 >= t0]
    step_s = statistics.median(gaps) if gaps else 0.0
    measured = restart_s()
    out = []
    for f in findings:
        if f.kind in kinds and f.step is not None:
            p = progress_lost(history, start=f.step, step_s=step_s)
            f = dataclasses.replace(f, details={
                **f.details, "progress_lost": None if p is None else p.as_details(),
                "restart_s": measured})
        out.append(f)
    return out


def throughput_findings(rows: list[LossRow], *, cfg: DetectionConfig) -> list[Finding]:
    points = []
    prev_t: float | None = None
    for r in rows:
        t = float(r["t_last"])
        if prev_t is not None and t > prev_t:
            points.append(ThroughputPoint(step=int(r["step"]), amount=float(r["samples"] or 0),
                                          seconds=t - prev_t))
        prev_t = t
    if not points or all(p.amount == 0 for p in points):
        return []
    return detect_throughput_decay(points, cfg=cfg.throughput)


def disk_findings(conn: Connection, run: RunRow, *, cfg: DetectionConfig,
                  agents: list[AgentLiveness] | None = None) -> list[Finding]:
    """Free share of each node's checkpoint file system; a node is in a low episode while
    its newest disk event is ``disk_low``."""
    if agents is None:
        agents = windows.agent_liveness(conn, run_id=run["id"])
    usage = {str(a["node"]): (int(a["disk_free_bytes"]), int(a["disk_total_bytes"]))
             for a in agents if a["disk_free_bytes"] is not None and a["disk_total_bytes"]}
    if not usage:
        return []
    latest = windows.latest_event_by_node(conn, run_id=run["id"],
                                       names=[FindingKind.DISK_LOW, FindingKind.DISK_RECOVERED])
    low = {node for node, name in latest.items() if name == FindingKind.DISK_LOW}
    return detect_disk(usage, low, cfg.disk)

"""Hang: no step progress within a deadline learned from the run's own step times.

A hung collective (or a SIGSTOPped rank) leaves every process alive, so liveness says nothing;
progress does.  The statistic is the *stall*: ``now`` minus the newest step report of the
attempt (any rank), compared with a deadline that depends on the phase of the attempt:

``startup``
    No step reported yet in this attempt: rendezvous, NCCL initialisation, model and checkpoint
    loading and the first (compiled) step.  Deadline ``startup_s`` from the attempt start.
``warmup``
    Fewer than ``warmup_steps`` steps reported in this attempt, or too little interval history
    to learn from: the first steps after a (re)start are slow (DDP rebuilds its buckets after
    the first iteration, ``torch.compile`` may recompile, allocators and autotuners warm up).
    Deadline ``max(warmup_s, learned)``.
``steady``
    Deadline ``learned = max(floor_s, k x p99(recent step intervals), longest_k x longest)``.

A checkpoint save in progress adds an allowance of ``max(checkpoint_s, save_k x the longest
recent save)`` counted from the moment the save began.

``finishing``
    A rank reported its training loop done (``worker_finished``, sent by
    ``Checkpointer.close()``): what follows is teardown (a final evaluation, the last save,
    the process group shutting down), which takes as long as it takes and has no step
    rhythm.  Deadline ``finish_s`` from that report; a run that never exits after it is still
    called hung, later.

Why the defaults: the project's target is detection within ``max(30 s, 10 x median step time)``.
``floor_s = 25`` (with delivery and the evaluator's tick, detection lands within 30 s) covers
every run with steps up to a few seconds.  ``k = 8`` on the p99 keeps the learned deadline at
or under ten median steps while the p99 is within 1.25 x the median (steady training), and a
gap eight times longer than the 99th-percentile interval is not jitter.  The floor also absorbs
report delivery delay (the worker flushes every 0.1 s, the
agent every 1 s).  Periodic slow steps the caller knows nothing about (evaluation every N
steps) are too rare to move a p99; pass ``longest_interval_s`` (the longest interval seen in
the run that did not end in a hang) and the deadline grows to ``longest_k`` times it.
Start-up, warm-up and save allowances are minutes because those phases legitimately take
minutes on large models (the NCCL default collective timeout is 10 minutes).

Per rank: in a hang every rank stops, but a rank that stopped first (SIGSTOP, stuck in I/O) is
often one or more steps behind the others; the hang finding names the rank furthest behind as
the suspect (``rank``) and lists every rank behind the newest step in ``details``.  A rank
that falls more than ``rank_lag_steps`` behind while the others keep reporting new steps for
longer than the deadline after its last report is an event ``rank_stalled`` (in synchronous
training that means its reports are being lost, not that it trains slower).

Times: step report ``t`` values are worker clocks and ``now`` the supervisor's; NTP-level skew
is noise next to the floor.  Pass ``observing_since`` (the supervisor's own start time) so a
supervisor that was down does not call a hang on data it could not receive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import ClassVar

from trainwarden.agent.core.bounds import bounded, check
from trainwarden.agent.core.findings import EVENT, INCIDENT, Finding, FindingKind
from trainwarden.agent.core.stats import median, quantile


@dataclass(frozen=True)
class HangConfig:
    """Deadlines, in seconds.  Every one can go down to about a second for tests."""

    SECTION: ClassVar[str] = "hang"  # the settings section: errors name hang.<field>

    k: float = bounded(8.0, gt=0, hint="try 8")  # x p99 of recent step intervals
    # the quantile of recent step intervals that k multiplies
    quantile: float = bounded(0.99, ge=0.5, le=1.0, hint="try 0.99")
    # The learned deadline is never shorter.  25 s: with the evaluator's tick and the
    # agents' one-second batches on top, a hang is called within the 30 s target.
    floor_s: float = bounded(25.0, gt=0)
    # intervals needed before the learned deadline is trusted
    min_intervals: int = bounded(5, ge=1)
    startup_s: float = bounded(600.0, gt=0)  # attempt start -> first step report
    warmup_steps: int = bounded(5, ge=0)  # the first steps of an attempt get warmup_s
    warmup_s: float = bounded(300.0, gt=0)  # the deadline of those first steps
    # a save in progress gets this much from its start ...
    checkpoint_s: float = bounded(600.0, gt=0)
    # ... or save_k x the longest recent save, whichever is longer
    save_k: float = bounded(3.0, ge=0)
    longest_k: float = bounded(1.5, ge=0)  # x the longest interval the run survived (if passed)
    finish_s: float = bounded(600.0, gt=0)  # the training loop reported done -> the workers exit
    rank_lag_steps: int = bounded(1, ge=0)  # "behind" for rank_stalled: more than this many steps

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class RankProgress:
    """A rank's newest step report in the current attempt."""

    step: int
    t: float  # unix time at the end of that step


@dataclass(frozen=True)
class ProgressWindow:
    """What the hang detector needs about the current attempt.

    ``ranks``: newest step report of each rank *of this attempt* (empty while none).
    ``steps_in_attempt``: how many steps have been reported in this attempt (0 while none).
    ``step_intervals``: recent seconds between consecutive steps (differences of the step end
    times, max over ranks; a few hundred is plenty); see ``intervals_from_times``.  They may
    come from earlier attempts of the run too.
    ``checkpoint_since``: unix time a checkpoint save began, while one is in progress; else None.
    ``recent_save_s``: durations of recent saves (``CheckpointReport.save_s``).
    ``longest_interval_s``: the longest step interval the run has had without a hang (optional).
    ``nodes``: rank -> node name, to name the node of a suspect rank.
    ``finished_at``: unix time a rank of this attempt reported its training loop done.
    """

    attempt_started_at: float
    ranks: Mapping[int, RankProgress] = field(default_factory=dict)
    steps_in_attempt: int = 0
    step_intervals: Sequence[float] = ()
    checkpoint_since: float | None = None
    recent_save_s: Sequence[float] = ()
    longest_interval_s: float | None = None
    observing_since: float | None = None
    nodes: Mapping[int, str] = field(default_factory=dict)
    finished_at: float | None = None


@dataclass(frozen=True)
class Deadline:
    """The deadline in force: the stall is measured from ``since``."""

    # "startup" | "warmup" | "steady" | "finishing" (+ "+checkpoint" while a save runs)
    phase: str
    since: float
    seconds: float
    learned_s: float | None  # the learned part, when there was enough history

    def expires_at(self) -> float:
        return self.since + self.seconds


def intervals_from_times(times: Sequence[float]) -> list[float]:
    """Seconds between consecutive step end times (ordered by step; non-positive gaps dropped)."""
    return [b - a for a, b in pairwise(times) if b > a]


def learned_deadline(w: ProgressWindow, cfg: HangConfig) -> float | None:
    """``max(floor_s, k x p99, longest_k x longest)`` or None with too few intervals."""
    xs = [x for x in w.step_intervals if x > 0]
    if len(xs) < cfg.min_intervals:
        return None
    d = max(cfg.floor_s, cfg.k * quantile(xs, cfg.quantile))
    if w.longest_interval_s is not None:
        d = max(d, cfg.longest_k * w.longest_interval_s)
    return d


def hang_deadline(w: ProgressWindow, cfg: HangConfig | None = None) -> Deadline:
    """The deadline in force for this window (also what a dashboard shows)."""
    cfg = cfg or HangConfig()
    last_t = max((p.t for p in w.ranks.values()), default=None)
    learned = learned_deadline(w, cfg)
    if w.finished_at is not None:
        phase = "finishing"
        since = max(w.finished_at, w.attempt_started_at, *([last_t] if last_t else []))
        seconds = max(cfg.finish_s, learned or cfg.floor_s)
    elif last_t is None or w.steps_in_attempt <= 0:
        phase, since, seconds = "startup", w.attempt_started_at, cfg.startup_s
    else:
        since = max(last_t, w.attempt_started_at)
        if learned is None or w.steps_in_attempt < cfg.warmup_steps:
            phase, seconds = "warmup", max(cfg.warmup_s, learned or cfg.floor_s)
        else:
            phase, seconds = "steady", learned
    if w.observing_since is not None and w.observing_since > since:
        since = w.observing_since
    if w.checkpoint_since is not None:
        allowance = max(cfg.checkpoint_s, cfg.save_k * max(w.recent_save_s, default=0.0))
        seconds = max(seconds, w.checkpoint_since + allowance - since)
        phase += "+checkpoint"
    return Deadline(phase=phase, since=since, seconds=seconds, learned_s=learned)


def detect_hang(w: ProgressWindow, now: float, cfg: HangConfig | None = None) -> list[Finding]:
    """A ``hang`` incident when the stall passed the deadline; ``rank_stalled`` events for ranks
    left behind while the others progress.  Empty when all is well."""
    cfg = cfg or HangConfig()
    dl = hang_deadline(w, cfg)
    stall = now - dl.since
    if stall > dl.seconds:
        return [_hang_finding(w, dl, stall)]
    return _stalled_ranks(w, dl, now, cfg)


def _fmt_ranks(ranks: Sequence[int], limit: int = 8) -> str:
    s = ", ".join(str(r) for r in ranks[:limit])
    return s + (f" (+{len(ranks) - limit} more)" if len(ranks) > limit else "")


def _hang_finding(w: ProgressWindow, dl: Deadline, stall: float) -> Finding:
    details: dict[str, object] = {
        "phase": dl.phase, "stall_s": round(stall, 3), "deadline_s": round(dl.seconds, 3),
        "learned_deadline_s": None if dl.learned_s is None else round(dl.learned_s, 3),
        "since": dl.since, "steps_in_attempt": w.steps_in_attempt,
    }
    intervals = [x for x in w.step_intervals if x > 0]
    if intervals:
        details["median_step_s"] = round(median(intervals), 4)
    if not w.ranks:
        msg = (f"hang: no step reported {stall:.1f} s after the attempt started "
               f"(start-up deadline {dl.seconds:.0f} s)")
        return Finding(kind=FindingKind.HANG, severity=INCIDENT, message=msg, started_at=dl.since,
                       details=details)
    newest = max(p.step for p in w.ranks.values())
    behind = sorted((r for r, p in w.ranks.items() if p.step < newest),
                    key=lambda r: (w.ranks[r].step, w.ranks[r].t, r))
    suspect = behind[0] if behind else None
    details["newest_step"] = newest
    details["ranks"] = len(w.ranks)
    details["behind"] = {str(r): w.ranks[r].step for r in behind}
    where = f"after step {newest}"
    if suspect is not None:
        node = w.nodes.get(suspect)
        where += (f"; rank {suspect}{f' on {node}' if node else ''} is furthest behind at step "
                  f"{w.ranks[suspect].step} (behind: {_fmt_ranks(behind)})")
    msg = (f"hang: no step progress for {stall:.1f} s {where} "
           f"(deadline {dl.seconds:.1f} s, phase {dl.phase})")
    return Finding(kind=FindingKind.HANG, severity=INCIDENT, message=msg, step=newest, rank=suspect,
                   node=w.nodes.get(suspect) if suspect is not None else None,
                   started_at=dl.since, details=details)


def _stalled_ranks(w: ProgressWindow, dl: Deadline, now: float, cfg: HangConfig
                   ) -> list[Finding]:
    if len(w.ranks) < 2:
        return []
    newest = max(p.step for p in w.ranks.values())
    newest_t = max(p.t for p in w.ranks.values())
    out = []
    for r, p in sorted(w.ranks.items()):
        silent = now - p.t
        # The others kept making progress for a whole deadline after this rank went quiet.
        if newest - p.step > cfg.rank_lag_steps and newest_t - p.t > dl.seconds:
            node = w.nodes.get(r)
            msg = (f"rank {r}{f' on {node}' if node else ''} last reported step {p.step} "
                   f"{silent:.1f} s ago while other ranks reached step {newest} "
                   f"(deadline {dl.seconds:.1f} s)")
            out.append(Finding(kind=FindingKind.RANK_STALLED, severity=EVENT, message=msg,
                               step=p.step, rank=r, node=node, started_at=p.t,
                               details={"rank_step": p.step, "newest_step": newest,
                                        "silent_s": round(silent, 3),
                                        "deadline_s": round(dl.seconds, 3)}))
    return out

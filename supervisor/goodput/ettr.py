"""Effective training time ratio (ETTR) and the badput by cause, accumulated incrementally.

ETTR = productive step time / wall time since the run started.  Every second of wall time goes
to exactly one part, so the parts add up to the wall time (to float rounding):

* ``productive``: step time of the steps on the final lineage (the chain of steps that made
  the model as it is now), less the data wait and straggler slowdown inside those steps;
* ``lost``: step time of steps that a restore threw away (a step redone after a rollback or a
  restart counts once, on the lineage; the copy that was thrown away is lost), of steps an
  older attempt still reported after a newer one was decided, and the time between the last
  completed step and a fault (the step in flight when it hit);
* ``detection``: the time from a fault to its incident (a hang's deadline, a crash's exit
  reaching the supervisor, a loss spike's first step to its incident): its non-step time,
  and the step time of the steps trained between the fault and the incident once a restore
  throws them away (a spike's rollback);
* ``restart``: non-step time from a restart decision to the first step of the new attempt
  (stopping the workers, backoff, torchrun, rendezvous, checkpoint load);
* ``startup``: the same for the run's first launch (from the run's start to its first step);
* ``requeue``: from the requeue of the run's scheduler job (no spare was free for a lost
  node: ``fleet.requeue``) to the restart decided on its new allocation: the wait for the
  scheduler, idle or not;
* ``checkpoint``: time the training loop was blocked on checkpoint saves (between steps);
* ``data_wait``: per step on the lineage, the median rank's wait for its batch;
* ``straggler``: per step on the lineage, (max over ranks of pre-collective time) - (median
  over ranks), pre-collective time being ``data_s + compute_s``: what the gang waited on its
  slowest rank beyond the typical one;
* ``capacity``: per step on the lineage, the step time beyond what the full world would take
  (``StepDone.capacity_s``): a run shrunk to fewer nodes keeps its global batch, so each of
  its steps is slower;
* ``idle``: no agent running (or the run ended and was later continued);
* ``other``: time between two steps of a running attempt that no save explains: evaluation,
  logging, the Python loop between two timed steps, steps whose report was lost.  It cannot
  be attributed further from what the workers report (they time their steps, not the rest of
  the loop), so it is kept as its own part instead of being hidden in another.

Priority where causes overlap: time inside a reported step is step time; of the rest,
detection first (a fault is being detected whatever the phase), then the step in flight at a
fault (``lost``), then the phase (requeue over idle over restart/startup/training gap).  A fault the
workers trained through (a loss spike: its incident comes after the steps that showed it,
``t_fault`` behind the cursor) is detection from ``t_fault`` to the incident all the same:
the gaps between those steps move from ``other`` (or ``checkpoint``) to ``detection`` when
the incident comes, and those steps' time goes to ``detection`` rather than ``lost`` when a
restore throws them away; steps a restore keeps stay productive (the training was not
lost).

Incremental: ``EttrAccumulator.feed`` takes one event at a time in time order (sort by
``event_time``) and keeps a small state: running totals, a cursor (the time up to which wall
time is attributed), the phase changes and fault windows after it (a handful), the cumulative
step parts at checkpoint steps (``max_marks``) and over the newest ``ring_steps`` steps, so a
rollback to a checkpoint moves the thrown-away steps to ``lost`` exactly without keeping every
step.  A rollback to a step that is neither a kept mark nor in the ring is interpolated
linearly in step index between the nearest kept points.  ``snapshot(now)`` gives the breakdown
at ``now`` without changing the state: the open time since the cursor goes to the current
phase's part (a hang not yet detected reads as ``other`` until its incident arrives).

Pure: no I/O, no clock; times are unix seconds as the store keeps them.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields

from trainwarden.agent.core.bounds import bounded, check
from trainwarden.supervisor.detect._stats import median
from trainwarden.supervisor.enums import NEVER_INTERRUPTING

PARTS = ("productive", "lost", "detection", "restart", "requeue", "startup", "checkpoint",
         "data_wait", "straggler", "capacity", "idle", "other")
BADPUT = PARTS[1:]

# Incident kinds that do not stop training: their cost is measured as it happens (straggler
# slowdown, slower steps), so no detection latency is counted for them.
NON_INTERRUPTING: frozenset[str] = NEVER_INTERRUPTING


# --------------------------------------------------------------------------------------------
# Events (what the integration feeds, from the store's rows)


@dataclass(frozen=True)
class StepDone:
    """One step of the gang (all ranks delivered it).

    ``t``: when the step ended (the newest rank's report time); ``step_s``: its wall time
    (the slowest rank's ``step_s``; ``None``: not timed, the step is taken to span from the
    previous step's end, less any checkpoint stall reported in between); ``data_s`` and
    ``straggler_s``: the parts of the step lost to data wait and to the slowest rank (see
    ``gang_step``); ``capacity_s``: the part beyond what the full world would take (a world
    shrunk to fewer nodes, the global batch kept)."""

    attempt: int
    step: int
    t: float
    step_s: float | None
    data_s: float = 0.0
    straggler_s: float = 0.0
    capacity_s: float = 0.0


@dataclass(frozen=True)
class CheckpointSaved:
    """A checkpoint of ``step`` steps done (resuming from it continues at step index ``step``)
    is complete; ``stall_s``: how long the training loop was blocked by it (a synchronous
    save: all of it; an asynchronous one: its staging).  ``released_at``: when the save call
    gave the loop back, for an asynchronous save that completes later, at ``t``: its stall is
    the gap before the step after ``released_at``, already attributed (to ``other``) by the
    time the save completes, so it is moved from there.  None: at ``t`` (a synchronous save,
    whose stall is the gap before the next step)."""

    t: float
    step: int
    stall_s: float = 0.0
    released_at: float | None = None


def save_stall_s(*, stall_s: object, save_s: object, async_save: bool) -> float | None:
    """How long one save blocked the training loop, from its checkpoint row: the stall its
    worker measured (``stall_s``: the save call, an asynchronous save's staging included);
    from a reporter that does not send it, a synchronous save's ``save_s`` and 0 for an
    asynchronous one (its staging unknown).  None: nothing usable (a sync save without a
    finite, non-negative ``save_s``)."""
    for v in (stall_s, None if async_save else save_s):
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) \
                and v >= 0:
            return float(v)
    return 0.0 if async_save else None


@dataclass(frozen=True)
class Incident:
    """An incident opened at ``t_detected`` for a fault at ``t_fault`` (None: unknown)."""

    t_detected: float
    kind: str
    t_fault: float | None = None


@dataclass(frozen=True)
class RestartDecided:
    """A restart (or rollback) action was created: the run goes to ``attempt``;
    ``resume_step``: the step it continues at, where the decision knows it (a rollback's
    target, the newest checkpoint's step), so the steps it throws away read as lost at once
    rather than when the new attempt reports ``Resumed``."""

    t: float
    attempt: int
    resume_step: int | None = None


@dataclass(frozen=True)
class Resumed:
    """Attempt ``attempt`` loaded its checkpoint and continues at step index ``step``."""

    t: float
    attempt: int
    step: int


@dataclass(frozen=True)
class AgentsDown:
    """From ``t`` no agent of the run is running."""

    t: float


@dataclass(frozen=True)
class AgentsUp:
    """From ``t`` an agent of the run is running again."""

    t: float


@dataclass(frozen=True)
class Requeued:
    """From ``t`` the run waits for its scheduler job's new allocation (the job was requeued
    without a lost node), until the next ``RestartDecided``."""

    t: float


@dataclass(frozen=True)
class RunEnded:
    """The run completed, failed or was stopped at ``t`` (wall time stops counting)."""

    t: float


Event = (StepDone | CheckpointSaved | Incident | RestartDecided | Resumed | AgentsDown
         | AgentsUp | Requeued | RunEnded)


def event_time(e: Event) -> float:
    """The time to order events by before feeding them."""
    return e.t_detected if isinstance(e, Incident) else e.t


@dataclass(frozen=True)
class RankTiming:
    """One rank's phase times of one step (``rank_steps`` columns)."""

    rank: int
    data_s: float | None = None
    compute_s: float | None = None
    step_s: float | None = None


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x >= 0


def gang_step(attempt: int, step: int, t: float, ranks: Iterable[RankTiming]) -> StepDone:
    """A ``StepDone`` from every rank's phase times of one step.

    ``step_s``: the slowest rank's; ``data_s``: the median rank's data wait;
    ``straggler_s``: max - median over ranks of ``data_s + compute_s`` (ranks missing either
    are left out; 0 with fewer than two).  Both are capped so that they never exceed the step:
    data wait + straggler <= max pre-collective time <= ``step_s``."""
    rows = list(ranks)
    return gang_step_values(
        attempt, step, t, [r.step_s for r in rows if r.step_s is not None],
        [r.data_s for r in rows if r.data_s is not None],
        [r.data_s + r.compute_s for r in rows
         if r.data_s is not None and r.compute_s is not None
         and _finite(r.data_s) and _finite(r.compute_s)])


_INF = math.inf


def gang_step_values(attempt: int, step: int, t: float, step_s: Sequence[float],
                     data_s: Sequence[float], pre_s: Sequence[float]) -> StepDone:
    """``gang_step`` from the ranks' values of each phase (``pre_s``: data_s + compute_s of
    the ranks that reported both); values that are not finite or negative are left out
    (``0 <= x < inf`` is ``_finite``: NaN fails it).  The live accounting's form: one call
    per step of up to 16,384 ranks, from lists read straight from the store."""
    steps = [x for x in step_s if 0 <= x < _INF]
    datas = [x for x in data_s if 0 <= x < _INF]
    pres = [x for x in pre_s if 0 <= x < _INF]
    top = max(steps) if steps else None
    data = median(datas) if datas else 0.0
    strag = (max(pres) - median(pres)) if len(pres) >= 2 else 0.0
    if top is not None:
        strag = min(strag, top)
        data = min(data, top - strag)
    return StepDone(attempt=attempt, step=step, t=t, step_s=top, data_s=data,
                    straggler_s=strag)


# --------------------------------------------------------------------------------------------
# The breakdown


@dataclass(frozen=True)
class Breakdown:
    """Where the wall time from ``start`` to ``end`` went, in seconds per part."""

    start: float
    end: float
    productive: float = 0.0
    lost: float = 0.0
    detection: float = 0.0
    restart: float = 0.0
    requeue: float = 0.0
    startup: float = 0.0
    checkpoint: float = 0.0
    data_wait: float = 0.0
    straggler: float = 0.0
    capacity: float = 0.0
    idle: float = 0.0
    other: float = 0.0
    steps_final: int = 0  # steps on the final lineage
    steps_lost: int = 0  # step copies thrown away by restores (and late or replayed ones)

    @property
    def wall_s(self) -> float:
        return self.end - self.start

    @property
    def ettr(self) -> float | None:
        """Productive / wall time; None before any wall time passed."""
        return self.productive / self.wall_s if self.wall_s > 0 else None

    def parts(self) -> dict[str, float]:
        return {p: getattr(self, p) for p in PARTS}

    def badput(self) -> dict[str, float]:
        return {p: getattr(self, p) for p in BADPUT}

    def as_dict(self) -> dict[str, object]:
        return {"start": self.start, "end": self.end, "wall_s": self.wall_s,
                "ettr": self.ettr, "parts_s": self.parts(), "steps_final": self.steps_final,
                "steps_lost": self.steps_lost}


def window(earlier: Breakdown, later: Breakdown) -> Breakdown:
    """The breakdown of the time between two snapshots of one run (for "ETTR over the last
    hours").  A rollback inside the window moves step time of before the window to ``lost``,
    so ``productive`` (and ``steps_final``) of a window can be negative: the window is charged
    with the loss when the restore happens."""
    vals = {f.name: getattr(later, f.name) - getattr(earlier, f.name) for f in fields(Breakdown)
            if f.name not in ("start", "end")}
    return Breakdown(start=earlier.end, end=later.end, **vals)


# --------------------------------------------------------------------------------------------
# The accumulator

STARTUP, TRAINING, RESTARTING, ENDED = "startup", "training", "restarting", "ended"
REQUEUE = "requeue"  # the scheduler job was requeued: waiting for its new allocation
_GAP = "gap"  # non-step time of a running attempt: checkpoint stall, else other


@dataclass(frozen=True)
class EttrConfig:
    # newest lineage steps whose cumulative parts are kept
    ring_steps: int = bounded(512, ge=1, hint="try 512")
    # checkpoint steps whose cumulative parts are kept (newest)
    max_marks: int = bounded(1024, ge=1, hint="try 1024")
    non_interrupting: frozenset[str] = NON_INTERRUPTING

    def __post_init__(self) -> None:
        check(self)


@dataclass
class _Cum:
    """Step parts summed over the lineage up to some step (productive, data, straggler, n,
    capacity)."""

    productive: float = 0.0
    data: float = 0.0
    straggler: float = 0.0
    steps: int = 0
    capacity: float = 0.0

    def copy(self) -> _Cum:
        return _Cum(self.productive, self.data, self.straggler, self.steps, self.capacity)

    def minus(self, o: _Cum) -> _Cum:
        return _Cum(self.productive - o.productive, self.data - o.data,
                    self.straggler - o.straggler, self.steps - o.steps,
                    self.capacity - o.capacity)

    @property
    def time(self) -> float:
        return self.productive + self.data + self.straggler + self.capacity


def _lerp(a: _Cum, b: _Cum, f: float) -> _Cum:
    return _Cum(a.productive + (b.productive - a.productive) * f,
                a.data + (b.data - a.data) * f, a.straggler + (b.straggler - a.straggler) * f,
                round(a.steps + (b.steps - a.steps) * f),
                a.capacity + (b.capacity - a.capacity) * f)


@dataclass(frozen=True)
class _State:
    phase: str
    idle: bool

    @property
    def label(self) -> str:
        if self.phase == REQUEUE:
            return "requeue"
        if self.idle or self.phase == ENDED:
            return "idle"
        return {STARTUP: "startup", RESTARTING: "restart"}.get(self.phase, _GAP)


@dataclass
class EttrAccumulator:
    """Feed a run's events in time order; ``snapshot(now)`` gives the breakdown."""

    start: float
    config: EttrConfig = field(default_factory=EttrConfig)

    def __post_init__(self) -> None:
        self._cursor = self.start  # wall time before it is attributed
        self._at_cursor = _State(STARTUP, False)
        self._changes: list[tuple[float, _State]] = []  # phase changes after the cursor
        self._windows: list[tuple[float, float, str]] = []  # (from, to, "detection"|"lost")
        # The lineage's step time (cumulative, [from, to)) trained while a fault went
        # undetected: detection, not lost, when a restore throws it away.
        self._undetected: tuple[float, float] | None = None
        self._ring_t: dict[int, float] = {}  # ring key -> when that step ended
        self._credit = 0.0  # checkpoint stall reported since the last step
        self._totals = dict.fromkeys(PARTS, 0.0)  # non-step parts and lost
        self._steps_lost = 0
        self._attempt: int | None = None
        self._last_step: int | None = None  # of the current attempt
        self._head: int | None = None  # next step index on the lineage (None: no lineage)
        self._base = 0  # the lineage's first step index
        self._cum = _Cum()
        self._ring: OrderedDict[int, _Cum] = OrderedDict()  # steps done -> cum
        self._marks: OrderedDict[int, _Cum] = OrderedDict()  # checkpoint steps -> cum
        self._end: float | None = None

    # -- state helpers ---------------------------------------------------------------------

    @property
    def _latest(self) -> _State:
        return self._changes[-1][1] if self._changes else self._at_cursor

    def _change(self, t: float, *, phase: str | None = None, idle: bool | None = None) -> None:
        cur = self._latest
        new = _State(cur.phase if phase is None else phase, cur.idle if idle is None else idle)
        if new == cur:
            return
        t = max(t, self._cursor, self._changes[-1][0] if self._changes else t)
        self._changes.append((t, new))
        if new.phase == ENDED and cur.phase != ENDED:
            self._end = t

    def _state_at(self, t: float) -> _State:
        s = self._at_cursor
        for ct, cs in self._changes:
            if ct > t:
                break
            s = cs
        return s

    def _split(self, a: float, b: float, credit: float) -> tuple[dict[str, float], float]:
        """Attribute the non-step time [a, b]; returns (parts, checkpoint credit used)."""
        out: dict[str, float] = {}
        if b <= a:
            return out, 0.0
        points = {a, b}
        points.update(t for t, _ in self._changes if a < t < b)
        for w0, w1, _ in self._windows:
            points.update(x for x in (w0, w1) if a < x < b)
        pts = sorted(points)
        for p, q in itertools.pairwise(pts):
            mid = (p + q) / 2
            label = self._state_at(mid).label
            kinds = {k for w0, w1, k in self._windows if w0 <= mid < w1}
            if "detection" in kinds:
                label = "detection"
            elif "lost" in kinds and label == _GAP:
                label = "lost"
            out[label] = out.get(label, 0.0) + (q - p)
        gap = out.pop(_GAP, 0.0)
        used = min(gap, credit)
        if used > 0:
            out["checkpoint"] = out.get("checkpoint", 0.0) + used
        if gap - used > 0:
            out["other"] = out.get("other", 0.0) + (gap - used)
        return out, used

    def _advance(self, b: float) -> None:
        """Attribute [cursor, b] as non-step time and move the cursor to b."""
        if b <= self._cursor:
            return
        parts, used = self._split(self._cursor, b, self._credit)
        for k, v in parts.items():
            self._totals[k] += v
        self._credit -= used
        self._move_cursor(b)

    def _move_cursor(self, b: float) -> None:
        self._cursor = max(self._cursor, b)
        while self._changes and self._changes[0][0] <= self._cursor:
            self._at_cursor = self._changes.pop(0)[1]
        self._windows = [w for w in self._windows if w[1] > self._cursor]

    # -- lineage ---------------------------------------------------------------------------

    def _cum_at(self, n: int) -> _Cum:
        """Cumulative step parts of the lineage's steps before index ``n``."""
        assert self._head is not None
        if n >= self._head:
            return self._cum.copy()
        if n <= self._base:
            return _Cum()
        for table in (self._marks, self._ring):
            if n in table:
                return table[n].copy()
        known = {self._base: _Cum(), self._head: self._cum}
        known.update(self._marks)
        known.update(self._ring)
        lo = max(k for k in known if k < n)
        hi = min(k for k in known if k > n)
        return _lerp(known[lo], known[hi], (n - lo) / (hi - lo))

    def _truncate(self, n: int) -> None:
        """The lineage continues at step index ``n``: the steps at and after it are lost."""
        if self._head is None:
            self._head = self._base = n
            return
        if n >= self._head:
            return
        keep = self._cum_at(n)
        gone = self._cum.minus(keep)
        detected = 0.0
        if self._undetected is not None:
            lo, hi = self._undetected
            detected = max(0.0, min(hi, self._cum.time) - max(lo, keep.time))
            self._undetected = None
        self._totals["detection"] += detected
        self._totals["lost"] += max(0.0, gone.time - detected)
        self._steps_lost += max(0, gone.steps)
        self._cum, self._head = keep, max(n, self._base)
        if n < self._base:
            self._base = self._head = n
        for table in (self._marks, self._ring, self._ring_t):
            for k in [k for k in table if k > n]:
                del table[k]

    def _append(self, step: int, productive: float, data: float, strag: float,
                t: float, capacity: float = 0.0) -> None:
        if self._head is None:
            self._head = self._base = step
        self._cum = _Cum(self._cum.productive + productive, self._cum.data + data,
                         self._cum.straggler + strag, self._cum.steps + 1,
                         self._cum.capacity + capacity)
        self._head = step + 1
        self._ring[self._head] = self._cum.copy()
        self._ring_t[self._head] = t
        while len(self._ring) > self.config.ring_steps:
            self._ring_t.pop(self._ring.popitem(last=False)[0], None)

    # -- feeding ---------------------------------------------------------------------------

    def feed(self, e: Event) -> None:
        if isinstance(e, StepDone):
            self._step(e)
        elif isinstance(e, CheckpointSaved):
            if not _finite(e.stall_s):
                pass
            elif e.released_at is not None and e.released_at <= self._cursor:
                moved = min(e.stall_s, self._totals["other"])
                self._totals["other"] -= moved
                self._totals["checkpoint"] += moved
            else:
                self._credit += e.stall_s
            if self._head is not None:
                cum = (self._cum if e.step == self._head else self._ring.get(e.step))
                if cum is not None:
                    self._marks[e.step] = cum.copy()
                    self._marks.move_to_end(e.step)
                    while len(self._marks) > self.config.max_marks:
                        self._marks.popitem(last=False)
        elif isinstance(e, Incident):
            self._incident(e)
        elif isinstance(e, RestartDecided):
            self._new_attempt(e.attempt)
            if e.resume_step is not None:
                self._truncate(e.resume_step)
            self._change(e.t, phase=RESTARTING)
        elif isinstance(e, Resumed):
            if self._attempt is None or e.attempt >= self._attempt:
                self._new_attempt(e.attempt)
                if self._last_step is None:  # (a late copy would cut the attempt's own steps)
                    self._truncate(e.step)
                if self._latest.phase == ENDED:
                    self._change(e.t, phase=RESTARTING)
        elif isinstance(e, AgentsDown):
            self._change(e.t, idle=True)
        elif isinstance(e, AgentsUp):
            self._change(e.t, idle=False)
        elif isinstance(e, Requeued):
            if self._latest.phase != ENDED:
                self._change(e.t, phase=REQUEUE)
        elif isinstance(e, RunEnded):
            self._change(e.t, phase=ENDED)
        else:  # pragma: no cover - the union is closed
            raise TypeError(f"not an ETTR event: {e!r}")

    def _new_attempt(self, attempt: int) -> None:
        if self._attempt is None or attempt > self._attempt:
            self._attempt = attempt
            self._last_step = None

    def _incident(self, e: Incident) -> None:
        if e.kind in self.config.non_interrupting:
            return
        t_fault = e.t_fault if e.t_fault is not None and e.t_fault <= e.t_detected \
            else e.t_detected
        if t_fault > self._cursor and self._state_at(t_fault).label == _GAP:
            # The step in flight when the fault hit never completed.
            self._windows.append((self._cursor, t_fault, "lost"))
        if t_fault < self._cursor and self._head is not None:
            self._detected_late(t_fault)
        if e.t_detected > t_fault:
            self._windows.append((t_fault, e.t_detected, "detection"))

    def _detected_late(self, t_fault: float) -> None:
        """A fault behind the cursor: the steps after it were trained while it went
        undetected (marked for the next restore) and the non-step time between them, already
        attributed, is detection."""
        assert self._head is not None
        after = [k for k, t in self._ring_t.items() if t > t_fault]
        # (a fault older than the ring: from the ring's oldest step)
        first = min(after, default=self._head + 1) - 1
        lo = self._cum_at(max(first, self._base)).time
        hi = self._cum.time
        self._undetected = (lo, hi)
        gaps = max(0.0, (self._cursor - t_fault) - (hi - lo))
        for part in ("other", "checkpoint"):
            moved = min(gaps, self._totals[part])
            self._totals[part] -= moved
            self._totals["detection"] += moved
            gaps -= moved

    def _step(self, e: StepDone) -> None:
        if self._attempt is None or e.attempt > self._attempt:
            self._new_attempt(e.attempt)
        late = e.attempt < (self._attempt or 0)  # an attempt already replaced
        replay = not late and self._last_step is not None and e.step <= self._last_step
        if not late and not replay and self._last_step is None and self._head is not None:
            self._truncate(e.step)  # first step of an attempt: where the lineage continues
        dur = e.step_s if e.step_s is not None and _finite(e.step_s) else None
        if dur is not None:
            begin = max(e.t - dur, self._cursor)
        elif not late and self._latest.label == _GAP:
            # Untimed: the step spans the time since the previous one, less the stall.
            begin = min(self._cursor + self._credit, max(e.t, self._cursor))
        else:
            begin = max(e.t, self._cursor)  # nothing to span from: the wait is not a step
        self._advance(begin)
        self._credit = 0.0  # a stall belongs to the gap before the next step
        if not late and (self._latest.phase != TRAINING or self._latest.idle):
            self._change(begin, phase=TRAINING, idle=False)
        credited = max(0.0, e.t - max(begin, self._cursor))
        total = dur if dur is not None else credited
        if late or replay:
            self._totals["lost"] += credited
            self._steps_lost += 1
        else:
            f = credited / total if total > 0 else 0.0
            data = max(0.0, e.data_s) * f if _finite(e.data_s) else 0.0
            strag = max(0.0, e.straggler_s) * f if _finite(e.straggler_s) else 0.0
            cap = max(0.0, e.capacity_s) * f if _finite(e.capacity_s) else 0.0
            strag = min(strag, credited)
            data = min(data, credited - strag)
            cap = min(cap, credited - strag - data)  # (the step's own parts come first)
            self._append(e.step, credited - data - strag - cap, data, strag, e.t, cap)
            self._last_step = e.step
        self._move_cursor(max(e.t, self._cursor))

    # -- reading ---------------------------------------------------------------------------

    def snapshot(self, now: float) -> Breakdown:
        """The breakdown from ``start`` to ``now`` (to the run's end once it ended)."""
        end = self._end if (self._end is not None and self._latest.phase == ENDED) else now
        end = max(end, self._cursor)
        totals = dict(self._totals)
        parts, _ = self._split(self._cursor, end, self._credit)
        for k, v in parts.items():
            totals[k] += v
        totals["productive"] = self._cum.productive
        totals["data_wait"] = self._cum.data
        totals["straggler"] = self._cum.straggler
        totals["capacity"] = self._cum.capacity
        return Breakdown(start=self.start, end=end, steps_final=self._cum.steps,
                         steps_lost=self._steps_lost, **totals)

    @property
    def cursor(self) -> float:
        """The time up to which wall time is attributed for good (bar later restores)."""
        return self._cursor

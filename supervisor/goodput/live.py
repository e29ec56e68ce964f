"""The live ETTR of one run: the store's new rows (read by ``trainwarden.supervisor.store.goodput``
after
the cursors kept here) turned into ``ettr`` events and fed to one ``EttrAccumulator``.

The evaluator keeps one ``LiveGoodput`` per run in its ``RunState`` and calls ``update`` each
tick with only the rows the run gained since the last one, so the cost of a tick follows the
new rows, never the length of the run.  Pure: no I/O, no clock.

What becomes which event:

* rank step rows -> ``StepDone`` once every rank of the run reported the step (``gang_step``:
  the slowest rank's ``step_s``, the median rank's data wait, the straggler slowdown); a step
  some rank never reported is taken as done once that attempt completes a later step;
* complete checkpoints -> ``CheckpointSaved`` (stall: ``ettr.save_stall_s``, the time the
  save call blocked the training loop as the worker measured it);
* incidents -> ``Incident`` (fault time: the exit report of the incident's agent and attempt,
  else when the condition began as its detector saw it (``started_at``: a loss spike's first
  step's time, the workers training on through it), else the end of that attempt's newest
  step: when progress stopped);
* restart actions -> ``RestartDecided`` at creation (a rollback's target as the resume step)
  and ``Resumed`` when it resumed; a restart whose membership runs fewer nodes than the run
  declares (a shrink) makes its attempt's steps complete with that share of the ranks, and
  each such step's time beyond the full world's (``1 - nodes / declared`` of it) is
  ``capacity``;
* the run's ``PresenceEvent`` rows -> ``AgentsDown`` at an ``agents_down``'s ``since`` (the
  newest heartbeat before the agents went silent for the node-lost deadline), ``AgentsUp`` at
  the first ``agent_registered`` after it (an agent process started) or an ``agents_up``;
  so ``idle`` is the time no agent ran, less the detection of the fault that stopped them
  (a node lost is detected first).  An agent back within the node-lost deadline leaves no
  idle time: that gap counts in the phase the run was in (a restart, else ``other``);
* the run's ``requeued`` event (its scheduler job put back in the queue) -> ``Requeued``;
* the run leaving the active statuses -> ``RunEnded``.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainwarden.supervisor.enums import ActionStatus, PresenceEvent, SupervisorEvent
from trainwarden.supervisor.goodput.ettr import (
    AgentsDown,
    AgentsUp,
    Breakdown,
    CheckpointSaved,
    EttrAccumulator,
    Event,
    Incident,
    Requeued,
    RestartDecided,
    Resumed,
    RunEnded,
    event_time,
    gang_step_values,
    save_stall_s,
    window,
)

# rank step rows read per tick (a catch-up after a supervisor restart takes several ticks)
STEP_ROWS_PER_TICK = 20_000
MAX_PARTIAL_STEPS = 4096  # steps waiting for their last rank, oldest dropped beyond

# API names of the badput causes, in the order the page stacks them, and the accumulator's
# part each reads.
CAUSES = {"lost_progress": "lost", "detection": "detection", "restart": "restart",
          "requeue": "requeue", "startup": "startup", "checkpoint": "checkpoint",
          "data_wait": "data_wait", "straggler": "straggler", "capacity": "capacity",
          "idle": "idle", "other": "other"}
NOT_MEASURED: dict[str, str] = {}  # causes not measured (null in the API), with the reason
FINAL_ACTION = frozenset({ActionStatus.RESUMED, ActionStatus.FAILED, ActionStatus.SUPERSEDED,
                          ActionStatus.DONE})

# (attempt, step, newest t, ranks, step_s values, data_s values, data_s + compute_s values):
# one step's rows read since the last tick
# (``trainwarden.supervisor.store.goodput.rank_step_groups_after``)
StepGroup = tuple[int, int, float, list[int], list[float], list[float], list[float]]


@dataclass
class _Partial:
    """A step some rank of the run has not reported yet (what its reported ranks said)."""

    t: float
    ranks: set[int]
    step_s: list[float]
    data_s: list[float]
    pre_s: list[float]

SERIES_EVERY_S = 60.0  # one point of the goodput series per minute of wall time ...
SERIES_POINTS = 1440  # ... over the last day


@dataclass
class LiveGoodput:
    """One run's accumulator and the cursors of the rows already fed."""

    start: float  # the run's creation
    acc: EttrAccumulator = field(init=False)
    step_id: int = 0
    checkpoint_id: int = 0
    incident_id: int = 0
    action_id: int = 0
    event_id: int = 0  # of the presence events (the newest event id read, of any run)
    down_since: float | None = None  # no agent has run since (an open ``agents_down``)
    pending_actions: set[int] = field(default_factory=set)
    decided: set[int] = field(default_factory=set)
    ended: bool = False
    _partial: dict[tuple[int, int], _Partial] = field(default_factory=dict)
    _last_step_t: dict[int, float] = field(default_factory=dict)  # attempt -> newest step end
    # attempt -> (nodes, declared nodes) of an attempt that runs fewer nodes than declared
    _shrunk: dict[int, tuple[int, int]] = field(default_factory=dict)
    # snapshots, one per SERIES_EVERY_S, for the series and the windowed ETTR
    history: deque[Breakdown] = field(default_factory=lambda: deque(maxlen=SERIES_POINTS))

    def __post_init__(self) -> None:
        self.acc = EttrAccumulator(start=self.start)

    # -- feeding -------------------------------------------------------------------------

    def update(self, *, steps: Sequence[StepGroup], steps_upto: int = 0, world: int,
               checkpoints: Iterable[Mapping[str, Any]] = (),
               incidents: Iterable[Mapping[str, Any]] = (),
               actions: Iterable[Mapping[str, Any]] = (),
               presence: Iterable[Mapping[str, Any]] = (), presence_upto: int = 0,
               ended_at: float | None = None, now: float | None = None) -> None:
        """Feed the rows read since the last call (each kind after its cursor, id order;
        ``steps_upto``: the id of the newest rank step row read, ``presence_upto`` of the
        newest event); ``now``: the time of the call, for the series (a point per
        ``SERIES_EVERY_S``)."""
        if self.ended:
            return
        self.step_id = max(self.step_id, steps_upto)
        self.event_id = max(self.event_id, presence_upto)
        self._feed(steps, world, checkpoints, incidents, actions, presence, ended_at)
        t = ended_at if ended_at is not None else now
        if t is not None and (ended_at is not None or not self.history
                              or t - self.history[-1].end >= SERIES_EVERY_S):
            self.history.append(self.acc.snapshot(t))

    def _feed(self, steps: Sequence[StepGroup], world: int,
              checkpoints: Iterable[Mapping[str, Any]],
              incidents: Iterable[Mapping[str, Any]],
              actions: Iterable[Mapping[str, Any]], presence: Iterable[Mapping[str, Any]],
              ended_at: float | None) -> None:
        actions = list(actions)
        for a in actions:  # first: an attempt's world is known before its steps
            self._learn_world(a)
        events: list[Event] = []
        events.extend(self._steps(steps, max(1, world)))
        for c in checkpoints:
            self.checkpoint_id = max(self.checkpoint_id, int(c["id"]))
            if c["complete"]:
                stall = save_stall_s(stall_s=c.get("stall_s"), save_s=c["save_s"],
                                     async_save=bool(c["async_save"]))
                events.append(CheckpointSaved(t=float(c["t"]), step=int(c["step"]),
                                              stall_s=stall or 0.0,
                                              released_at=_released_at(c, stall)))
        for inc in incidents:
            self.incident_id = max(self.incident_id, int(inc["id"]))
            fault = inc.get("exit_t")
            if fault is None:
                fault = inc.get("started_at")
            if fault is None:
                fault = self._last_step_t.get(int(inc["attempt"]))
            events.append(Incident(t_detected=float(inc["opened_at"]), kind=str(inc["kind"]),
                                   t_fault=None if fault is None else float(fault)))
        for a in actions:  # (after the incidents: one at a decision's time comes first)
            events.extend(self._action(a))
        for p in presence:
            events.extend(self._presence(p))
        events.sort(key=event_time)
        for e in events:
            self.acc.feed(e)
        if ended_at is not None:
            self.acc.feed(RunEnded(t=max(ended_at, self.acc.cursor)))
            self.ended = True

    def _steps(self, groups: Sequence[StepGroup], world: int) -> list[Event]:
        # A step's ranks are a set, so telling whether every rank is in costs O(1) per row
        # (a step of a 16,384-rank run has 16,384 rows, often read over two ticks).
        done: list[tuple[int, int]] = []
        partial = self._partial
        for attempt, step, t, ranks, step_s, data_s, pre_s in groups:
            key = (attempt, step)
            p = partial.get(key)
            if p is None:
                p = partial[key] = _Partial(t, set(ranks), step_s, data_s, pre_s)
            else:
                p.t = max(p.t, t)
                p.ranks.update(ranks)
                p.step_s += step_s
                p.data_s += data_s
                p.pre_s += pre_s
            if len(p.ranks) >= self._ranks_of(attempt, world):
                done.append(key)
        out: list[Event] = []
        for key in done:
            if key not in partial:
                continue
            # a step of the same attempt some rank never reported counts as done now
            for older in sorted(k for k in partial if k[0] == key[0] and k[1] < key[1]):
                out.append(self._gang(older))
            out.append(self._gang(key))
        while len(partial) > MAX_PARTIAL_STEPS:
            out.append(self._gang(min(partial)))
        return out

    def _ranks_of(self, attempt: int, world: int) -> int:
        """The ranks a step of ``attempt`` has: the run's, or its share on a shrunk world."""
        shrunk = self._shrunk.get(attempt)
        return world if shrunk is None else max(1, world * shrunk[0] // shrunk[1])

    def _gang(self, key: tuple[int, int]) -> Event:
        p = self._partial.pop(key)
        self._last_step_t[key[0]] = max(p.t, self._last_step_t.get(key[0], p.t))
        done = gang_step_values(key[0], key[1], p.t, p.step_s, p.data_s, p.pre_s)
        shrunk = self._shrunk.get(key[0])
        if shrunk is None or done.step_s is None:
            return done
        return dataclasses.replace(done, capacity_s=done.step_s * (1 - shrunk[0] / shrunk[1]))

    def _action(self, a: Mapping[str, Any]) -> list[Event]:
        aid = int(a["id"])
        self.action_id = max(self.action_id, aid)
        out: list[Event] = []
        if aid not in self.decided:
            self.decided.add(aid)
            rb = a.get("rollback_to_step")
            out.append(RestartDecided(t=float(a["created_at"]), attempt=int(a["attempt"]),
                                      resume_step=None if rb is None else int(rb)))
        status = str(a["status"])
        progress = a.get("progress") or {}
        if status == ActionStatus.RESUMED and a.get("resumed_step") is not None:
            t = progress.get("resumed", a["created_at"])
            out.append(Resumed(t=float(t), attempt=int(a["attempt"]),
                               step=int(a["resumed_step"])))
        if status in FINAL_ACTION:
            self.pending_actions.discard(aid)
        else:
            self.pending_actions.add(aid)
        return out

    def _learn_world(self, a: Mapping[str, Any]) -> None:
        """A restart whose membership runs fewer nodes than declared: its attempt's steps
        have that share of the ranks, and their extra time is capacity lost."""
        m = (a.get("plan") or {}).get("membership")
        if isinstance(m, dict) and isinstance(m.get("nnodes"), int) and isinstance(
                m.get("declared"), int) and 0 < m["nnodes"] < m["declared"]:
            self._shrunk[int(a["attempt"])] = (int(m["nnodes"]), int(m["declared"]))

    def _presence(self, p: Mapping[str, Any]) -> list[Event]:
        name, details = p["name"], p.get("details") or {}
        if name == SupervisorEvent.REQUEUED:
            return [Requeued(t=float(p["t"]))] if details.get("ok") else []
        if name == PresenceEvent.AGENTS_DOWN and self.down_since is None:
            since = _number(details.get("since"), float(p["t"]))
            self.down_since = since
            return [AgentsDown(t=since)]
        if self.down_since is not None and name in (PresenceEvent.AGENT_REGISTERED,
                                                    PresenceEvent.AGENTS_UP):
            at = _number(details.get("at"), float(p["t"]))
            at = max(at, self.down_since)
            self.down_since = None
            return [AgentsUp(t=at)]
        return []

    # -- reading -------------------------------------------------------------------------

    def as_dict(self, now: float) -> dict[str, Any]:
        """The API's ``goodput`` object at ``now``."""
        return breakdown_dict(self.acc.snapshot(now))

    def series(self, now: float, window_s: float) -> dict[str, Any]:
        """The breakdown now, over the last ``window_s`` (from the newest point at least
        that old, else the oldest kept: ``window`` says which span it covers), and the
        points kept (cumulative since the run's start, one per ``SERIES_EVERY_S``)."""
        current = self.acc.snapshot(now)
        earlier = next((b for b in reversed(self.history) if b.end <= now - window_s), None)
        if earlier is None:
            earlier = self.history[0] if self.history else None
        win = window(earlier, current) if earlier is not None and earlier.end < current.end \
            else current
        return {"current": breakdown_dict(current), "window": breakdown_dict(win),
                "points": [breakdown_dict(b) for b in self.history]}


def _number(v: Any, default: float) -> float:
    ok = isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    return float(v) if ok else default


def _released_at(c: Mapping[str, Any], stall: float | None) -> float | None:
    """When an asynchronous save gave the training loop back: its completion less the
    background part (``save_s`` - stall); None for a synchronous save (at its completion)."""
    save_s = c["save_s"]
    if not c["async_save"] or stall is None or not isinstance(save_s, int | float) \
            or not math.isfinite(save_s) or save_s < stall:
        return None
    return float(c["t"]) - (float(save_s) - stall)


def breakdown_dict(b: Breakdown) -> dict[str, Any]:
    """A breakdown as the API shows it: the causes by their API names, those not measured
    null (with the reason)."""
    parts = b.parts()
    badput: dict[str, float | None] = {
        cause: None if cause in NOT_MEASURED else parts[part] for cause, part in CAUSES.items()}
    return {"ettr": b.ettr, "wall_s": b.wall_s, "productive_s": b.productive,
            "badput_s": badput, "not_measured": dict(NOT_MEASURED),
            "steps_final": b.steps_final, "steps_lost": b.steps_lost,
            "start": b.start, "end": b.end}

"""The anatomy of a restart: seconds per phase from the timestamps of its milestones.

Milestones, in order (``MILESTONES``), and what marks each in the store today:

* ``decided``: the restart action was created (``actions.created_at``);
* ``workers_stopped``: the old attempt's workers are gone on every node (the newest ``exits``
  row of the old attempt; a crash's workers may already be gone before the decision);
* ``torchrun_started``: every agent relaunched torchrun (the newest of the agents'
  ``torchrun_started`` events of the new attempt; from agents that do not send it, when the
  supervisor received the last "done" ``command_result`` for the action's commands);
* ``rendezvous_done``: every rank of the new attempt is in the process group (the newest
  ``worker_started`` event of the attempt: sent after ``init_process_group`` returns);
* ``preflight_done``: every rank finished its preflight health check (the newest
  ``preflight`` event of the attempt; a worker whose preflight is turned off sends one
  saying so at once, so the phase is 0 rather than unknown);
* ``checkpoint_loaded``: rank 0 restored the checkpoint (the attempt's ``resumed`` event);
* ``first_step``: the first step of the new attempt was reported (``step_aggregates.t_last``
  of the attempt's first step, or ``actions.progress["resumed"]``).

``trainwarden.supervisor.store.efficiency.restart_milestones`` reads them.

Phases are the spans between consecutive milestones (``PHASES``).  A milestone that is
missing (an older agent, a dropped report) leaves the phases on both sides of it unknown
(``None``, never 0); ``spans`` then merges them into one known span from the previous known
milestone to the next, labelled with both names.  A milestone earlier than one before it
(a crash's workers stopped before the decision; clocks of different hosts) gives a phase of
0 with a note, never a negative one, and the next phase counts from the later milestone, so
the known phases never overlap and add up to ``total_s``.  Pure: timestamps in, seconds out.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

MILESTONES = ("decided", "workers_stopped", "torchrun_started", "rendezvous_done",
              "preflight_done", "checkpoint_loaded", "first_step")
PHASES = ("stop_workers", "launch", "rendezvous", "preflight", "load_checkpoint", "first_step")
# Histogram buckets (seconds) for a per-phase metric: from a CPU test run's ~1 s phases to
# a large job's minutes-long rendezvous and checkpoint load.
PHASE_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


@dataclass(frozen=True)
class Span:
    name: str  # a phase name, or "a+b" for phases merged over a missing milestone
    start: str  # milestone names
    end: str
    seconds: float


@dataclass(frozen=True)
class Anatomy:
    times: dict[str, float | None]
    phases: dict[str, float | None]  # phase -> seconds, None when a bound is unknown
    spans: tuple[Span, ...]  # consecutive known milestones, merged over missing ones
    total_s: float | None  # decided -> first step, when both are known
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, object]:
        return {"times": self.times, "phases_s": self.phases, "total_s": self.total_s,
                "spans": [{"phase": s.name, "from": s.start, "to": s.end,
                           "seconds": s.seconds} for s in self.spans],
                "notes": list(self.notes)}


def anatomy(times: Mapping[str, float | None]) -> Anatomy:
    """Seconds per phase from milestone times (unix seconds; missing or None: unknown)."""
    unknown = set(times) - set(MILESTONES)
    if unknown:
        raise ValueError(f"unknown restart milestones {sorted(unknown)}; "
                         f"known: {', '.join(MILESTONES)}")
    t: dict[str, float | None] = {m: times.get(m) for m in MILESTONES}
    notes: list[str] = []
    # Each milestone counts from the latest one before it, so phases never overlap and the
    # known phases add up to the total: a crash's workers stopped before the decision, so
    # its launch phase starts at the decision, not at the exit.
    eff: dict[str, float | None] = {}
    latest: float | None = None
    for i, m in enumerate(MILESTONES):
        tm = t[m]
        if tm is None:
            eff[m] = None
            continue
        if latest is not None and tm < latest:
            phase = PHASES[i - 1]
            notes.append("the workers had stopped before the decision (a crash): "
                         "stop_workers 0" if m == "workers_stopped" else
                         f"{m} is {latest - tm:.3f} s before an earlier milestone "
                         f"(clock skew between hosts?): {phase} counted as 0")
        latest = tm if latest is None else max(latest, tm)
        eff[m] = latest
    phases: dict[str, float | None] = {}
    for name, a, b in zip(PHASES, MILESTONES, MILESTONES[1:], strict=False):
        ea, eb = eff[a], eff[b]
        phases[name] = None if ea is None or eb is None else eb - ea
    spans: list[Span] = []
    known = [(i, m) for i, m in enumerate(MILESTONES) if eff[m] is not None]
    for (i, a), (j, b) in itertools.pairwise(known):
        ea, eb = eff[a], eff[b]
        assert ea is not None and eb is not None
        spans.append(Span("+".join(PHASES[i:j]), a, b, eb - ea))
    first, last = eff["decided"], eff["first_step"]
    total = None if first is None or last is None else last - first
    return Anatomy(times=t, phases=phases, spans=tuple(spans), total_s=total,
                   notes=tuple(notes))

"""The final lineage: which attempt's rows stand for each step of a run.

A restart resumes from a checkpoint, so a new attempt trains again the steps from its
checkpoint on; the old attempt's rows of those steps (and of the steps it trained after the
decision, before the restart reached its workers) belong to a history that no longer leads
to the model.  The final lineage is the chain of steps that made the model as it is now:

* attempt ``a``'s row of step ``s`` is on it unless a newer attempt starts at or before
  ``s``;
* an attempt starts at its first reported step, or, once a rollback to step ``k`` is
  decided for it, at ``k`` already (its workers will resume there: the old attempt's steps
  from ``k`` on are superseded from the decision, as its checkpoints beyond ``k`` are
  abandoned).

So each step has at most one row on the lineage: the newest attempt that reached it among
those whose history continues to the present.  The steps API, the dashboard's charts,
``/metrics``, the loss and throughput detectors and the efficiency figures all choose rows
with ``cuts`` (the store turns them into one SQL condition); a superseded row is shown apart
(the loss chart's thin lines), never merged into a lineage step.  The ETTR accumulator
(``ettr``) applies the same rule as its events arrive, without the rows: a restart decided
with a rollback target, or a new attempt's first step, throws away the lineage's steps from
there on, and a step of an older attempt completed after a newer one was decided is lost.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping


def cuts(starts: Mapping[int, int]) -> dict[int, int | None]:
    """attempt -> the step from which its rows are superseded (None: none are), for every
    attempt of ``starts`` (attempt -> the step it starts at, see the module docstring)."""
    out: dict[int, int | None] = {}
    cut: int | None = None
    for attempt in sorted(starts, reverse=True):  # newest first: each cut by those after it
        out[attempt] = cut
        start = starts[attempt]
        cut = start if cut is None else min(cut, start)
    return out


"""The final lineage of a run in SQL: the starts ``trainwarden.supervisor.goodput.lineage.cuts``
reads, and its cuts as one condition on a table's (attempt, step) columns.  Every per-step
read that spans attempts (the steps API, the loss window, the efficiency figures) chooses its
rows with ``condition``, so a step counts one attempt's rows wherever it is shown or judged."""

from __future__ import annotations

from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, func, or_, select, true

from trainwarden.supervisor.enums import ActionKind
from trainwarden.supervisor.goodput.lineage import cuts
from trainwarden.supervisor.store.tables import actions, step_aggregates

Cuts = dict[int, int | None]


def attempt_starts(conn: Connection, *, run_id: int) -> dict[int, int]:
    """attempt -> the step it starts at: its first stored step, or the step a rollback
    decided for it goes back to when that is lower (or it has no step yet)."""
    a = step_aggregates.c
    # A loose index scan of the primary key (run_id, attempt, step): one seek per attempt
    # instead of every step of the run (read every evaluator tick).
    first = (select(func.min(a.attempt).label("attempt")).where(a.run_id == run_id)
             .cte("attempts", recursive=True))
    later = select(select(func.min(a.attempt)).where(a.run_id == run_id,
                                                     a.attempt > first.c.attempt)
                   .scalar_subquery()).where(first.c.attempt.is_not(None))
    every = first.union_all(later)
    lowest = (select(func.min(a.step)).where(a.run_id == run_id, a.attempt == every.c.attempt)
              .scalar_subquery())
    starts = {int(att): int(s) for att, s in conn.execute(
        select(every.c.attempt, lowest).where(every.c.attempt.is_not(None)))}
    ac = actions.c
    for att, k in conn.execute(select(ac.attempt, ac.rollback_to_step).where(
            ac.run_id == run_id, ac.kind == ActionKind.RESTART,
            ac.rollback_to_step.is_not(None))):
        starts[int(att)] = min(int(k), starts.get(int(att), int(k)))
    return starts


def run_cuts(conn: Connection, *, run_id: int) -> Cuts:
    """``lineage.cuts`` of the run as the store holds it now."""
    return cuts(attempt_starts(conn, run_id=run_id))


def condition(lineage: Cuts, attempt: Any, step: Any) -> ColumnElement[bool]:
    """The rows of ``lineage`` (``run_cuts``) among those of one run, on a table's ``attempt``
    and ``step`` columns.  An attempt newer than every one it knows (its rows stored after
    the cuts were read) is on the lineage."""
    cut = {att: k for att, k in lineage.items() if k is not None}
    if not cut:
        return true()
    newest = max(lineage)
    return or_(attempt >= newest, *(and_(attempt == att, step < k) for att, k in cut.items()))


def superseded(lineage: Cuts, attempt: Any, step: Any) -> ColumnElement[bool] | None:
    """The rows off ``lineage`` (the complement of ``condition``); None when there are none."""
    cut = {att: k for att, k in lineage.items() if k is not None}
    if not cut:
        return None
    return or_(*(and_(attempt == att, step >= k) for att, k in cut.items()))

"""The run status moves only as ``RUN_TRANSITIONS`` lists, on SQLite and Postgres: every
listed move is made, any other is refused with a named error and changes nothing."""

from __future__ import annotations

import pytest
from sqlalchemy import select, update

from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.enums import FINAL_STATUSES, RUN_TRANSITIONS, RunStatus
from trainwarden.supervisor.store import registry, tables
from trainwarden.supervisor.store.db import Database

MOVES = [(a, b) for a in RunStatus for b in RunStatus]


def _run_in(db: Database, status: RunStatus) -> int:
    with db.write() as c:
        run_id = registry.register_agent(
            c, req=wire.RegisterRequest(run="r", node="n0"), now=1.0)["run_id"]
        c.execute(update(tables.runs).where(tables.runs.c.id == run_id)
                  .values(status=status, reason="before", attempt=3, restarts=2,
                          updated_at=5.0))
    return int(run_id)


def _row(db: Database, run_id: int) -> tuple[object, ...]:
    r = tables.runs.c
    with db.read() as c:
        return tuple(c.execute(select(r.status, r.reason, r.attempt, r.restarts, r.updated_at)
                               .where(r.id == run_id)).one())


def test_the_table_names_every_status_and_an_ended_run_never_moves() -> None:
    assert set(RUN_TRANSITIONS) == set(RunStatus)
    assert {s for s, to in RUN_TRANSITIONS.items() if not to} == FINAL_STATUSES
    assert all(to <= set(RunStatus) for to in RUN_TRANSITIONS.values())


@pytest.mark.parametrize(("src", "to"), MOVES, ids=[f"{a}-{b}" for a, b in MOVES])
def test_a_listed_move_is_made_and_any_other_refused(db: Database, src: RunStatus,
                                                     to: RunStatus) -> None:
    run_id = _run_in(db, src)
    before = _row(db, run_id)
    if to in RUN_TRANSITIONS[src]:
        with db.write() as c:
            registry.set_run_status(c, run_id=run_id, status=to, now=9.0, reason="moved",
                                    attempt=4, restarts=3)
        assert _row(db, run_id) == (to, "moved", 4, 3, 9.0)
        return
    with pytest.raises(registry.RunTransitionRefused) as e, db.write() as c:
        registry.set_run_status(c, run_id=run_id, status=to, now=9.0, reason="moved",
                                attempt=4, restarts=3)
    assert (e.value.run_id, e.value.status, e.value.to) == (run_id, src, to)
    assert f"run {run_id} is {src}: it may not become {to}" in str(e.value)
    assert _row(db, run_id) == before


def test_a_run_that_does_not_exist_is_left_alone(db: Database) -> None:
    with db.write() as c:
        registry.set_run_status(c, run_id=99, status=RunStatus.RUNNING, now=9.0)

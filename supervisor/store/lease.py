"""The evaluator lease: which supervisor replica on a shared database runs the evaluator.

One row per lease name (``evaluator_lease``): its holder, its epoch, and when it expires.
``acquire`` takes a lease nobody holds or whose holder let it expire, and moves its epoch on
by one; ``renew`` extends the holder's own lease (its epoch unchanged); ``release`` ends it
at once (a clean shutdown: a standby takes it on its next try).  ``check_epoch`` is the
fence: run first in every write transaction of the evaluator, it reads the lease row with a
row lock (``FOR SHARE`` on Postgres) and refuses (``Fenced``) unless the epoch is still the
writer's.  The lock is held until that transaction ends, so a standby's ``acquire`` (an
``UPDATE`` of the same row) waits for it: a decision either commits before the lease
changes hands or is refused after, never both leaders' decisions at once.

Times are unix seconds of one clock for every replica: the database's (``database_time``)
on Postgres, so replicas with skewed clocks agree on when a lease expires.  Keyword-only
functions taking a ``Connection``.
"""

from __future__ import annotations

from typing import TypedDict, cast

from sqlalchemy import Connection, select, text, update

from trainwarden.supervisor.store._sql import insert, row
from trainwarden.supervisor.store.tables import evaluator_lease

EVALUATOR = "evaluator"  # the name of the evaluator's lease


class LeaseRow(TypedDict):
    name: str
    holder: str
    epoch: int
    acquired_at: float
    renewed_at: float
    expires_at: float


class Fenced(Exception):
    """A write of a lease holder whose epoch is no longer the lease's: rolled back."""

    def __init__(self, *, name: str, epoch: int, current: LeaseRow | None) -> None:
        self.epoch, self.current = epoch, current
        now = ("nobody holds it" if current is None else
               f"epoch {current['epoch']} is {current['holder']}'s")
        super().__init__(f"lease {name!r}: epoch {epoch} is no longer this replica's ({now}); "
                         "its decision was refused and rolled back")


def database_time(conn: Connection) -> float | None:
    """The database server's clock in unix seconds (Postgres); None where the store has no
    clock of its own to share (SQLite: one process, its own clock)."""
    if conn.dialect.name != "postgresql":
        return None
    return float(conn.execute(text("SELECT extract(epoch FROM clock_timestamp())")).scalar_one())


def current(conn: Connection, *, name: str = EVALUATOR) -> LeaseRow | None:
    r = conn.execute(select(evaluator_lease).where(evaluator_lease.c.name == name)).first()
    return cast(LeaseRow, row(r)) if r else None


def acquire(conn: Connection, *, holder: str, now: float, duration_s: float,
            name: str = EVALUATOR) -> LeaseRow | None:
    """Take the lease if nobody holds it or it expired (``expires_at <= now``): the holder
    becomes ``holder`` with the next epoch, until ``now + duration_s``.  None when another
    holder's lease is still live (or this holder's own: ``renew`` that)."""
    values = {"holder": holder, "acquired_at": now, "renewed_at": now,
              "expires_at": now + duration_s}
    first = insert(conn, evaluator_lease).values(name=name, epoch=1, **values)
    first = first.on_conflict_do_nothing(index_elements=["name"])
    if conn.execute(first.returning(evaluator_lease.c.epoch)).first() is not None:
        return current(conn, name=name)
    c = evaluator_lease.c
    # On Postgres a concurrent acquire waits for this row's lock, then sees the new expiry
    # and takes nothing; a fenced write in flight (``check_epoch``) holds it until it ends.
    taken = conn.execute(update(evaluator_lease)
                         .where(c.name == name, c.expires_at <= now)
                         .values(epoch=c.epoch + 1, **values)
                         .returning(c.epoch)).first()
    return current(conn, name=name) if taken is not None else None


def renew(conn: Connection, *, holder: str, epoch: int, now: float, duration_s: float,
          name: str = EVALUATOR) -> bool:
    """Extend the holder's lease of ``epoch`` to ``now + duration_s``.  False when the lease
    moved on (another epoch): the holder is deposed.  A lease that expired but that nobody
    took since is still the holder's (nobody else decided meanwhile): renewed."""
    c = evaluator_lease.c
    r = conn.execute(update(evaluator_lease)
                     .where(c.name == name, c.holder == holder, c.epoch == epoch)
                     .values(renewed_at=now, expires_at=now + duration_s))
    return bool(r.rowcount)


def release(conn: Connection, *, holder: str, epoch: int, now: float,
            name: str = EVALUATOR) -> bool:
    """End the holder's lease now (a clean shutdown): the next ``acquire`` takes it."""
    c = evaluator_lease.c
    r = conn.execute(update(evaluator_lease)
                     .where(c.name == name, c.holder == holder, c.epoch == epoch)
                     .values(expires_at=now))
    return bool(r.rowcount)


def check_epoch(conn: Connection, *, epoch: int, name: str = EVALUATOR,
                hold_s: float | None = None) -> None:
    """The fence: raise ``Fenced`` unless the lease's epoch is ``epoch``.  Run first in the
    write transaction it guards (the row lock it takes lasts until that transaction ends).

    ``hold_s`` (Postgres): the server ends the session if the writer leaves the transaction
    idle for that long (a process paused mid-transaction), so a paused leader's row lock
    cannot keep a standby from taking the lease; its decision is then rolled back."""
    if hold_s is not None and conn.dialect.name == "postgresql":
        ms = max(1, int(hold_s * 1000))
        conn.exec_driver_sql(f"SET LOCAL idle_in_transaction_session_timeout = {ms}")
    c = evaluator_lease.c
    held = conn.execute(select(c.epoch).where(c.name == name).with_for_update(read=True)
                        ).scalar()
    if held is None or int(held) != epoch:
        raise Fenced(name=name, epoch=epoch, current=current(conn, name=name))

"""Engine construction and the write lock.

SQLite: WAL (readers never block the writer), ``synchronous=NORMAL`` (durable at checkpoints,
safe with WAL), ``busy_timeout`` for other processes, foreign keys on.  Inside one process the
writers are serialised by a Python lock instead of SQLite's busy handler, whose sleep-and-retry
backoff adds tens of milliseconds to a contended write (the ingest p99 target is 100 ms).

Postgres (``postgresql+psycopg://``): a connection pool sized for the API thread pool; no
process lock, row locks do the work; a session idle inside a transaction for 15 s is ended
(``POSTGRES_IDLE_IN_TRANSACTION_S``: replicas share the rows).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url

__all__ = ["Connection", "Database", "KeptConnection", "StoreConfig", "make_database",
           "make_engine"]

# ``Connection`` is what every store function takes; the rest of the supervisor names the type
# through this module and never imports SQLAlchemy itself.

SQLITE_BUSY_TIMEOUT_MS = 10_000


@dataclass(frozen=True)
class StoreConfig:
    # SQLAlchemy URL (postgresql+psycopg://user@host/db); unset: SQLite in data_dir
    url: str | None = None
    data_dir: Path = Path("./trainwarden-data")  # where the default SQLite file is kept

    @property
    def database_url(self) -> str:
        """The effective database URL (``url``, or the SQLite file in ``data_dir``)."""
        if self.url:
            return self.url
        return f"sqlite:///{(Path(self.data_dir) / 'trainwarden.db').resolve()}"


class Database:
    """An engine plus the lock that serialises writes when the backend needs it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.is_sqlite = engine.dialect.name == "sqlite"
        self._write_lock: contextlib.AbstractContextManager[Any] = (
            threading.Lock() if self.is_sqlite else contextlib.nullcontext()
        )

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """One write transaction (committed on success, rolled back on any exception)."""
        with self._write_lock, self.engine.begin() as conn:
            yield conn

    @contextlib.contextmanager
    def write_on(self, conn: Connection) -> Iterator[Connection]:
        """A write transaction on a connection the caller keeps (the ingest writer's: no pool
        checkout and pre-ping per transaction)."""
        with self._write_lock, conn.begin():
            yield conn

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        with self.engine.connect() as conn:
            yield conn

    def kept(self) -> KeptConnection:
        """A write connection for one thread to keep across its transactions."""
        return KeptConnection(self)

    @property
    def url(self) -> str:
        """The engine's URL, password included (for the schema migrations)."""
        return self.engine.url.render_as_string(hide_password=False)

    def dispose(self) -> None:
        self.engine.dispose()

    def fenced(self, check: Callable[[Connection], None]) -> Database:
        """This database (same engine, same write lock) with ``check`` run first in every
        write transaction (``write``, ``write_on``, ``kept``): the evaluator lease's fence
        (``store.lease.check_epoch``), whose refusal rolls the transaction back before
        anything is written."""
        return _FencedDatabase(self, check)


class _FencedDatabase(Database):
    def __init__(self, inner: Database, check: Callable[[Connection], None]) -> None:
        super().__init__(inner.engine)
        self._write_lock = inner._write_lock
        self._check = check

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        with self._write_lock, self.engine.begin() as conn:
            self._check(conn)
            yield conn

    @contextlib.contextmanager
    def write_on(self, conn: Connection) -> Iterator[Connection]:
        # (``kept()`` connections write through here: fenced too)
        with self._write_lock, conn.begin():
            self._check(conn)
            yield conn


class KeptConnection:
    """A write connection one thread keeps across transactions: no pool checkout and pre-ping
    per transaction.  After a failed transaction it is dropped (it may be broken), and the
    next ``write`` opens a fresh one."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self._conn: Connection | None = None

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        if self._conn is None:
            self._conn = self.db.engine.connect()
        try:
            with self.db.write_on(self._conn) as conn:
                yield conn
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = None


def make_engine(url: str, *, pool_size: int = 20, echo: bool = False) -> Engine:
    u = make_url(url)
    if u.get_backend_name() == "sqlite":
        db = u.database
        if db and db != ":memory:" and not db.startswith("file:"):
            Path(db).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(
            u,
            echo=echo,
            # One connection per thread is fine for SQLite; the pool avoids reopen costs.
            pool_size=pool_size,
            max_overflow=pool_size,
            connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_MS / 1000},
        )
        event.listen(engine, "connect", _sqlite_on_connect)
        # pysqlite's own transaction handling defers BEGIN; emit it ourselves (and IMMEDIATE is
        # unnecessary because writers are serialised by Database.write's lock).
        event.listen(engine, "begin", _sqlite_begin)
        return engine
    engine = create_engine(
        u, echo=echo, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True
    )
    event.listen(engine, "connect", _postgres_on_connect)
    return engine


def open_error(url: str) -> str | None:
    """Why the store at ``url`` cannot be opened, in one line that names the fix (None: it
    opens).  Checked before the server starts, so a wrong URL, a database that does not exist
    or a server that is down is said at once instead of as a traceback from the start-up."""
    try:
        u = make_url(url)
    except Exception as e:
        return f"cannot read the database URL {url!r}: {e}"
    shown = u.render_as_string(hide_password=True)
    try:
        engine = make_engine(url, pool_size=1)
    except Exception as e:
        return f"cannot open the database {shown}: {_first_line(e)}"
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")
    except Exception as e:
        why = _first_line(getattr(e, "orig", None) or e)
        return f"cannot open the database {shown}: {why}{_fix(u, why)}"
    finally:
        engine.dispose()
    return None


def _first_line(e: BaseException) -> str:
    """The driver's own words: its first line, without libpq's "connection to server at ...
    failed:" preamble (the URL is said already)."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    if "failed: " in text:
        text = text.rsplit("failed: ", 1)[1]
    return " ".join(text.split())


def _fix(u: Any, why: str) -> str:
    if "does not exist" in why and u.database:
        return (f"; create it (createdb {u.database}, or CREATE DATABASE {u.database}) or "
                "point --db at one that exists")
    if "refused" in why.lower() or "could not connect" in why.lower():
        return (f"; is the database server running at {u.host or 'localhost'}:{u.port or 5432}"
                "? start it, or point --db at one that is")
    if "password" in why.lower() or "authentication" in why.lower():
        return "; check the user and password in --db"
    return ""


# Postgres: a session left idle inside a transaction this long is ended by the server.  No
# transaction of the supervisor waits between its statements; a replica that is paused (a
# frozen VM, SIGSTOP) inside one would otherwise hold its row locks, and with them the other
# replicas' writes of the same rows (an agent's batch resent to another replica), until it
# wakes.  The evaluator's fenced transactions use the shorter lease duration.
POSTGRES_IDLE_IN_TRANSACTION_S = 15


def _postgres_on_connect(dbapi_conn: Any, _record: Any) -> None:
    with dbapi_conn.cursor() as cur:
        cur.execute("SET idle_in_transaction_session_timeout = "
                    f"{POSTGRES_IDLE_IN_TRANSACTION_S * 1000}")
    dbapi_conn.commit()


def _sqlite_begin(conn: Connection) -> None:
    # Straight to the driver: this runs for every transaction.
    conn.connection.dbapi_connection.execute("BEGIN")  # type: ignore[union-attr]


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # Let SQLAlchemy's "begin" event issue BEGIN (pysqlite's implicit handling is off).
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def make_database(url: str, **kw: Any) -> Database:
    return Database(make_engine(url, **kw))

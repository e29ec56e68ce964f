"""The ingest writer: group commit for agent batches.

Requests hand their validated batch to the writer and await the result; the writer stores
everything that queued up meanwhile in ONE transaction (``store.ingest.ingest_batches``): at
low load a group is one batch (latency is one transaction), at high load many (the per-batch
cost falls: one commit, one multi-row statement per table).  Why a single writer: SQLite has
one writer anyway, and on Postgres concurrent ingest transactions of one run all update the
same per-step aggregate row, so they would queue on its row lock.

Where the group is written depends on the store:

* SQLite (``inline``): on the event loop itself, in the loop iteration after the requests
  that queued: their handlers all reach their ``await`` first, so a group is every batch the
  loop read in one iteration.  SQLite's writes are CPU-bound and serialised; a thread hop
  measured slower (the GIL hand-offs cost more than the grouping saves).
* Postgres: in a writer thread, which waits on the network while the loop goes on.

A group that fails is retried batch by batch, so one bad batch cannot fail its neighbours.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from typing import Any

from trainwarden.supervisor.clock import Clock
from trainwarden.supervisor.contract import wire
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.ingest import IngestConfig, IngestResult, ingest_batches

log = logging.getLogger("trainwarden.ingest")

MAX_GROUP = 512

_Item = tuple[wire.IngestBatch, "asyncio.Future[Any]", asyncio.AbstractEventLoop]


class IngestWriter:
    def __init__(self, db: Database, clock: Clock, *, max_group: int = MAX_GROUP,
                 cfg: IngestConfig | None = None) -> None:
        self.db = db
        self.clock = clock
        # The agent-clock rule (the inline SQLite path reads it here too).
        self.cfg = cfg or IngestConfig()
        self.max_group = max_group
        self._q: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.inline = db.is_sqlite
        # one connection across groups, used by the writer only (the thread, or the loop)
        self._kept = db.kept()
        self._due: list[tuple[wire.IngestBatch, asyncio.Future[Any]]] = []  # inline only
        self.groups = 0  # counters for tests and benchmarks
        self.batches = 0

    async def submit(self, batch: wire.IngestBatch) -> IngestResult:
        """Store ``batch``; raises ``UnknownAgent`` (or a store error) as ``ingest_batch``."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        if self.inline:
            if not self._due:
                loop.call_soon(self._write_due)
            self._due.append((batch, fut))
        else:
            self._ensure_started()
            self._q.put((batch, fut, loop))
        res = await fut
        if isinstance(res, BaseException):
            raise res
        assert isinstance(res, IngestResult)
        return res

    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        with self._start_lock:
            if self._thread is None:
                th = threading.Thread(target=self._run, name="trainwarden-ingest", daemon=True)
                th.start()
                self._thread = th

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is not None:
            self._q.put(None)
            self._thread.join(timeout)
        elif self.inline:
            self._kept.close()

    def _write_due(self) -> None:
        """The inline writer (on the event loop): every batch queued since the last group."""
        group, self._due = self._due, []
        for (_batch, fut), res in zip(group, self._store([b for b, _ in group]), strict=True):
            _resolve(fut, res)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._kept.close()

    def _loop(self) -> None:
        while True:
            first = self._q.get()
            if first is None:
                return
            group = [first]
            stop = False
            while len(group) < self.max_group:
                try:
                    item = self._q.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    stop = True
                    break
                group.append(item)
            self._write(group)
            if stop:
                return

    def _store(self, batches: list[wire.IngestBatch]) -> list[Any]:
        """One group in one transaction; each batch's outcome (or the exception it raised)."""
        now = self.clock()
        results: list[Any]
        try:
            # A failed group drops the kept connection (it may be broken); the next group
            # takes a fresh one.
            with self._kept.write() as conn:
                results = list(ingest_batches(conn, batches=batches, now=now, cfg=self.cfg))
        except Exception:
            if len(batches) > 1:
                log.warning("ingest group of %d failed; retrying batch by batch", len(batches),
                            exc_info=True)
            results = []
            for batch in batches:
                try:
                    with self.db.write() as conn:
                        results.append(ingest_batches(conn, batches=[batch], now=now,
                                                      cfg=self.cfg)[0])
                except Exception as e:
                    log.exception("ingest of agent %s seq %s failed", batch.agent_id, batch.seq)
                    results.append(e)
        self.groups += 1
        self.batches += len(batches)
        return results

    def _write(self, group: list[_Item]) -> None:
        results = self._store([g[0] for g in group])
        for (_batch, fut, loop), res in zip(group, results, strict=True):
            # RuntimeError: the request's event loop is gone (shutdown).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, fut, res)


def _resolve(fut: asyncio.Future[Any], res: Any) -> None:
    if not fut.done():  # the client may have gone away (cancelled)
        fut.set_result(res)

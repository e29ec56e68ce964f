"""Undelivered ingest batches on disk: bounded, replayed oldest first, survives the agent.

Every batch goes through the spool, reachable supervisor or not: one code path, and a batch
created just before the agent dies is replayed by the next incarnation.  A file per batch,
named ``<seq:012d>-<items>.json`` so the directory listing is the replay order and the item
count (for the ``dropped`` counter) is known without reading the file.

Thread safety: the main loop adds batches while the sender thread reads and removes them; one
lock guards the index.  The batch being sent is never dropped by the bound (``in_flight``), so
a delivered batch is not also counted as dropped.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from trainwarden.agent.deadletter import DeadLetters

log = logging.getLogger(__name__)


class Spool:
    def __init__(self, directory: Path, *, max_bytes: int, max_batches: int,
                 dead_letters: DeadLetters | None = None) -> None:
        self.dir = directory
        # Where refused or unreadable batches go (``set_aside``).
        self.dead = dead_letters or DeadLetters(directory.parent / "dead-letter")
        self.max_bytes = max_bytes
        self.max_batches = max_batches
        self.dropped_items = 0  # by the bound, in this incarnation (the caller persists totals)
        self.dropped_batches = 0
        self.in_flight: int | None = None
        self._lock = threading.Lock()
        self._index: dict[int, tuple[Path, int, int]] = {}  # seq -> (path, bytes, items)
        self.dir.mkdir(parents=True, exist_ok=True)
        for p in self.dir.glob("*.json"):
            parsed = _parse_name(p.name)
            if parsed is None:
                continue
            try:
                size = p.stat().st_size
            except OSError:
                continue
            self._index[parsed[0]] = (p, size, parsed[1])
        for p in self.dir.glob("*.tmp"):  # a write the previous agent did not finish
            p.unlink(missing_ok=True)

    # -- queries -----------------------------------------------------------------------------

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(size for _, size, _ in self._index.values())

    def seqs(self) -> list[int]:
        with self._lock:
            return sorted(self._index)

    def oldest(self, *, skip: int | None = None) -> tuple[int, dict[str, Any]] | None:
        """The oldest batch (other than ``skip``), marked in flight until
        ``remove``/``set_aside``/``release``."""
        while True:
            with self._lock:
                seqs = [s for s in self._index if s != skip]
                if not seqs:
                    return None
                seq = min(seqs)
            entry = self.get(seq)
            if entry is not None:
                return entry

    def get(self, seq: int) -> tuple[int, dict[str, Any]] | None:
        """Batch ``seq`` marked in flight, or None when it is gone (dropped by the bound) or
        unreadable (then it is set aside)."""
        with self._lock:
            if seq not in self._index:
                return None
            path = self._index[seq][0]
            self.in_flight = seq
        try:
            return seq, json.loads(path.read_text())
        except (OSError, ValueError) as e:
            # Unreadable (disk trouble, truncated): it cannot be sent, so set it aside.
            log.error("spooled batch %s is unreadable (%s): set aside in %s", path, e,
                      self.dead.dir)
            self.set_aside(seq, f"unreadable spool file: {e}")
            return None

    # -- changes -----------------------------------------------------------------------------

    def add(self, batch: dict[str, Any]) -> None:
        seq = int(batch["seq"])
        n_items = len(batch.get("items", ()))
        data = json.dumps(batch, separators=(",", ":")).encode()
        path = self.dir / f"{seq:012d}-{n_items}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # atomic: a crash leaves the whole batch or none of it
        with self._lock:
            self._index[seq] = (path, len(data), n_items)
            self._enforce_bound()

    def _enforce_bound(self) -> None:
        """Drop the oldest batches (never the one in flight) until within both bounds."""
        total = sum(size for _, size, _ in self._index.values())
        for seq in sorted(self._index):
            if len(self._index) <= self.max_batches and total <= self.max_bytes:
                break
            if seq == self.in_flight or seq == max(self._index):
                continue  # never the batch on the wire, never the one just added
            path, size, n_items = self._index.pop(seq)
            path.unlink(missing_ok=True)
            total -= size
            self.dropped_items += n_items
            self.dropped_batches += 1
            log.warning("spool full: dropped batch seq=%d (%d items)", seq, n_items)

    def remove(self, seq: int) -> None:
        with self._lock:
            entry = self._index.pop(seq, None)
            if self.in_flight == seq:
                self.in_flight = None
        if entry is not None:
            entry[0].unlink(missing_ok=True)

    def release(self, seq: int) -> None:
        """The send failed; the batch stays first in line."""
        with self._lock:
            if self.in_flight == seq:
                self.in_flight = None

    def set_aside(self, seq: int, reply: str) -> Path | None:
        """Move a batch that can never be delivered into the dead-letter store, with
        ``reply`` (the supervisor's answer, or why) beside it; returns where it went."""
        with self._lock:
            entry = self._index.pop(seq, None)
            if self.in_flight == seq:
                self.in_flight = None
        if entry is None:
            return None
        return self.dead.put(entry[0], reply)

    def renumber(self, first_seq: int) -> int:
        """Shift every batch so the oldest gets ``first_seq``, order kept; returns the shift.

        Used when the supervisor already stored higher sequence numbers for this agent than
        our (lost) state knows: the spooled batches are new, and must not read as replays."""
        with self._lock:
            if not self._index:
                return 0
            shift = first_seq - min(self._index)
            if shift <= 0:
                return 0
            new_index: dict[int, tuple[Path, int, int]] = {}
            for seq in sorted(self._index, reverse=True):  # highest first: no name clashes
                path, _size, n_items = self._index[seq]
                batch = json.loads(path.read_text())
                batch["seq"] = seq + shift
                data = json.dumps(batch, separators=(",", ":")).encode()
                new_path = self.dir / f"{seq + shift:012d}-{n_items}.json"
                tmp = new_path.with_suffix(".tmp")
                tmp.write_bytes(data)
                os.replace(tmp, new_path)
                path.unlink(missing_ok=True)
                new_index[seq + shift] = (new_path, len(data), n_items)
            self._index = new_index
            return shift


def _parse_name(name: str) -> tuple[int, int] | None:
    stem = name.removesuffix(".json")
    parts = stem.split("-")
    if len(parts) != 2 or not all(x.isdigit() for x in parts):
        return None
    return int(parts[0]), int(parts[1])

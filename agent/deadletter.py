"""Batches the supervisor refused, set aside on disk for a human: bounded, oldest dropped first.

A batch lands here when the supervisor answers it with a final 4xx, when it keeps failing
with a 5xx while newer batches are accepted (see ``trainwarden.agent.uplink``), or when its spool
file
cannot be read.  Each entry is the batch file as it was spooled (``<seq:012d>-<items>.json``)
and, beside it, ``<same name>.reply.txt``: the HTTP status and the supervisor's reply, or why
the batch could not be sent.  Both bounds (bytes and entries) drop the oldest entries first
and count them, so a supervisor that refuses everything cannot fill the node's disk.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)

# Defaults of the agent's --dead-letter-* settings (AgentConfig uses these).
MAX_BYTES = 64 * 1024 * 1024
MAX_BATCHES = 1000
# The reply kept beside a batch is cut to this many characters.
MAX_REPLY_CHARS = 64 * 1024
REPLY_SUFFIX = ".reply.txt"


class DeadLetters:
    def __init__(self, directory: Path, *, max_bytes: int = MAX_BYTES,
                 max_batches: int = MAX_BATCHES) -> None:
        self.dir = directory
        self.max_bytes = max_bytes
        self.max_batches = max_batches
        self.dropped = 0  # entries dropped by the bounds, in this incarnation
        self._lock = threading.Lock()

    def entries(self) -> list[Path]:
        """The batch files kept, oldest (lowest seq) first."""
        if not self.dir.is_dir():
            return []
        return sorted(self.dir.glob("*.json"))

    def put(self, batch_file: Path, reply: str) -> Path | None:
        """Move ``batch_file`` here with ``reply`` beside it; returns where it went (None when
        it could not be kept: the file is then deleted, the failure logged)."""
        dest = self.dir / batch_file.name
        with self._lock:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                os.replace(batch_file, dest)
                _reply_path(dest).write_text(reply[:MAX_REPLY_CHARS])
            except OSError as e:
                log.error("could not set batch %s aside in %s: %s", batch_file.name, self.dir, e)
                batch_file.unlink(missing_ok=True)
                return None
            self._enforce_bound(keep=dest)
        return dest

    def _enforce_bound(self, *, keep: Path) -> None:
        sizes = {}
        for p in self.entries():
            try:
                sizes[p] = p.stat().st_size + _size(_reply_path(p))
            except OSError:
                continue
        total = sum(sizes.values())
        count = len(sizes)
        for p in sorted(sizes):
            if count <= self.max_batches and total <= self.max_bytes:
                break
            if p == keep:
                continue  # the newest entry stays, whatever its size
            p.unlink(missing_ok=True)
            _reply_path(p).unlink(missing_ok=True)
            total -= sizes[p]
            count -= 1
            self.dropped += 1
            log.warning("dead-letter store full: dropped the oldest entry %s", p.name)


def _reply_path(batch_file: Path) -> Path:
    return batch_file.with_name(batch_file.name.removesuffix(".json") + REPLY_SUFFIX)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0

"""Why a checkpoint save failed, and what its disk has left: the report a failed save sends.

A save fails far more often because of where it writes than because of what it saves: a full
disk or quota, a file system gone read-only, unmounted or removed, an I/O error.  A restart
fixes none of these (it saves to the same disk again, and loses the steps since the last good
checkpoint on the way), so the Checkpointer never lets such a failure end training: it removes
the partial save, reports it with what is said here, and the next save tries again.

DCP's save is collective, and so is its failure: a rank whose write fails makes DCP raise
``CheckpointException`` (a ``BaseException``, not an ``Exception``) on every rank, carrying
the same per-rank failures everywhere (checked with torchrun: a 600 KiB tmpfs filled by rank
1's shard; ranks 0 and 1 both raised, each holding both ranks' failures).  Every rank takes
the same decision from it, so no rank goes on to a collective the others skip.

A full disk does not always say so: ``torch.save``'s zip writer turns the short write into
``RuntimeError: [enforce fail at inline_container.cc:...] unexpected pos 704 vs 598`` (rank 0
above), with no errno.  A failure without one whose file system has (almost) no room left is
read as a full disk, and so is that zip writer's "unexpected pos" itself (a write that
wrote less than it was given).  The room is read before the partial save is removed.
"""

from __future__ import annotations

import errno as errnos
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

__all__ = ["SaveFailure", "SaveFailureReason", "analyse", "disk_usage", "is_save_failure"]

# torch.save's zip writer finding fewer bytes in the file than it wrote: a short write.
_SHORT_WRITE = re.compile(r"inline_container\.cc:\d+\]? ?\.? ?unexpected pos \d+ vs \d+")
# A file system with at most this much room left (or 1% of its size, whichever is less) after
# a failed write is full.
NEARLY_FULL_BYTES = 1 << 20


class SaveFailureReason(StrEnum):
    DISK_FULL = "disk_full"  # ENOSPC, EDQUOT, or a failed write with no room left
    READ_ONLY = "read_only"  # EROFS
    VANISHED = "vanished"  # the directory or its file system went away
    IO_ERROR = "io_error"  # EIO
    OTHER = "other"


_REASON_OF_ERRNO = {
    errnos.ENOSPC: SaveFailureReason.DISK_FULL, errnos.EDQUOT: SaveFailureReason.DISK_FULL,
    errnos.EROFS: SaveFailureReason.READ_ONLY, errnos.ENOENT: SaveFailureReason.VANISHED,
    errnos.ESTALE: SaveFailureReason.VANISHED, errnos.ENODEV: SaveFailureReason.VANISHED,
    errnos.ENOTDIR: SaveFailureReason.VANISHED, errnos.EIO: SaveFailureReason.IO_ERROR,
}

# What a person reads first (the supervisor keys nothing on these words; ``reason`` is the
# machine-readable one).
WHAT = {
    SaveFailureReason.DISK_FULL: "checkpoint disk full",
    SaveFailureReason.READ_ONLY: "checkpoint file system read-only",
    SaveFailureReason.VANISHED: "checkpoint directory gone",
    SaveFailureReason.IO_ERROR: "checkpoint disk I/O error",
    SaveFailureReason.OTHER: "checkpoint save failed",
}


def is_save_failure(e: BaseException) -> bool:
    """A failure a save survives: DCP's collective one (every rank got it) or an OS error
    (rank 0's own finishing steps: the metadata file, the rename)."""
    return isinstance(e, CheckpointException | OSError)


def _per_rank(e: BaseException, rank: int) -> dict[int, BaseException]:
    if isinstance(e, CheckpointException):
        out = {}
        for r, wrapped in e.failures.items():
            exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(exc, BaseException):
                out[int(r)] = exc
        if out:
            return out
    return {rank: e}


def _chain(e: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _os_error(e: BaseException) -> OSError | None:
    return next((x for x in _chain(e) if isinstance(x, OSError) and x.errno), None)


def disk_usage(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(free, total) bytes of the file system holding ``path`` (its nearest existing
    ancestor: the directory may be gone); None when none can be read."""
    p = Path(path).absolute()
    for q in (p, *p.parents):
        try:
            u = shutil.disk_usage(q)
        except OSError:
            continue
        return int(u.free), int(u.total)
    return None


@dataclass(frozen=True)
class SaveFailure:
    """One failed save, as every rank reads it from the same exception."""

    reason: SaveFailureReason
    errno: int | None
    error: str  # "OSError: [Errno 28] No space left on device"
    ranks: tuple[int, ...]  # the ranks whose part failed
    free_bytes: int | None
    total_bytes: int | None

    @property
    def what(self) -> str:
        return WHAT[self.reason]

    @property
    def reporter(self) -> int:
        """The one rank that reports it: the lowest that failed (its node is the one named)."""
        return min(self.ranks)

    def details(self, **more: Any) -> dict[str, Any]:
        return {"reason": str(self.reason), "errno": self.errno,
                "errno_name": errnos.errorcode.get(self.errno) if self.errno else None,
                "error": self.error[:500], "ranks": list(self.ranks)[:64],
                "free_bytes": self.free_bytes, "total_bytes": self.total_bytes, **more}


def analyse(e: BaseException, *, rank: int, root: str | os.PathLike[str]) -> SaveFailure:
    """What the save that raised ``e`` on ``rank`` failed of, and the room left under
    ``root`` (read now: call it before the partial save is removed)."""
    per_rank = _per_rank(e, rank)
    found = [(r, x, _os_error(x)) for r, x in sorted(per_rank.items())]
    # The first rank's OS error with a known meaning, else the first with any errno.
    known = [f for f in found if f[2] is not None and f[2].errno in _REASON_OF_ERRNO]
    pick = known[0] if known else next((f for f in found if f[2] is not None), found[0])
    _, exc, os_err = pick
    usage = disk_usage(root)
    code = os_err.errno if os_err is not None else None
    reason = _REASON_OF_ERRNO.get(code, SaveFailureReason.OTHER) if code else \
        SaveFailureReason.OTHER
    if reason == SaveFailureReason.OTHER and (
            any(_SHORT_WRITE.search(str(x)) for _, x, _ in found)
            or (usage is not None and usage[0] <= min(NEARLY_FULL_BYTES, usage[1] // 100))):
        reason = SaveFailureReason.DISK_FULL  # a short write with no errno (see above)
    shown = os_err if os_err is not None else exc
    error = f"{type(shown).__name__}: {shown}".splitlines()[0] if str(shown) else \
        type(shown).__name__
    return SaveFailure(reason=reason, errno=code, error=error,
                       ranks=tuple(sorted(per_rank)),
                       free_bytes=usage[0] if usage else None,
                       total_bytes=usage[1] if usage else None)


def human_bytes(n: int | None) -> str:
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"

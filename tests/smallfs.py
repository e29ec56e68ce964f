"""A small file system that really fills: a tmpfs of a few MiB, mounted for one test.

Only root may mount one (CI runs as root on the same kind of machine); elsewhere the tests
that need it are skipped, saying why.  The mount is always undone, whatever the test did."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def why_not() -> str | None:
    """Why a tmpfs cannot be mounted here (None: it can)."""
    if os.geteuid() != 0:
        return "mounting a small tmpfs (a disk that really fills) needs root"
    return None


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """``path`` as a tmpfs of ``size`` (``3m``) for the block; skips the test where no tmpfs
    can be mounted."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on {path}: {done.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def remount(path: Path, option: str) -> None:
    """Remount the tmpfs at ``path`` with ``option`` (``ro``, ``rw``)."""
    subprocess.run(["mount", "-o", f"remount,{option}", str(path)], check=True)


def fill(path: Path, *, leave: int = 0) -> Path:
    """A filler file taking all the room of ``path``'s file system but ``leave`` bytes."""
    filler = path / "filler"
    free = os.statvfs(path).f_bavail * os.statvfs(path).f_frsize
    with open(filler, "ab") as f, contextlib.suppress(OSError):
        f.write(b"\0" * max(0, free - leave))
    return filler

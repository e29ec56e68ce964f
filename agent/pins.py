"""Pins on checkpoints: the ``PINNED`` marker file that the workers' retention honours
(``trainwarden.agent.worker.Checkpointer.apply_retention`` never deletes a pinned checkpoint).

The agent pins for two purposes: the target of the restart it is applying (``restart``), and
what the supervisor says to protect (``protect``: the last good checkpoint before an open
incident, the target of a pending rollback).  A marker this agent wrote is removed once no
purpose holds its checkpoint any more; markers somebody else wrote (``ckpt.pin``) are left
alone.

The paths come over the network, so a pin is written only inside the checkpoint roots this
agent knows (``--checkpoint-root``, or else the training command's ``--checkpoint-dir`` and
the directories of the checkpoints its own workers reported): resolved, symlinks followed,
strictly below a root.  Anything else is refused, logged once and counted (``take_refused``
hands the new refusals to the agent, which reports them), and no file is ever written or
removed outside the roots.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from trainwarden.agent.protocol import PIN_FILE

log = logging.getLogger(__name__)


def inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Does ``path`` resolve (symlinks followed) to a path strictly below ``root``?"""
    try:
        p, r = Path(path).resolve(), Path(root).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return False
    return p != r and p.is_relative_to(r)


class CheckpointPins:
    def __init__(self, saved: Mapping[str, Any] | None = None,
                 roots: Iterable[Path] = ()) -> None:
        self.held: dict[str, set[str]] = {}
        for purpose, paths in (saved or {}).items():
            if isinstance(paths, list):
                self.held[str(purpose)] = {str(p) for p in paths if isinstance(p, str)}
        # The checkpoint roots pins may be written under (set by the agent as it learns them).
        self.roots: list[Path] = list(roots)
        self.refused = 0  # distinct paths refused, in this incarnation
        self._refused_paths: set[str] = set()
        self._new_refusals: list[tuple[str, str]] = []

    def state(self) -> dict[str, list[str]]:
        """What to persist (an agent restarted later lifts its predecessor's pins in time)."""
        return {k: sorted(v) for k, v in self.held.items() if v}

    def paths(self) -> set[str]:
        return set().union(*self.held.values()) if self.held else set()

    def allowed(self, path: str) -> bool:
        return any(inside(path, root) for root in self.roots)

    def take_refused(self) -> list[tuple[str, str]]:
        """(path, why) of the paths refused since the last call."""
        out, self._new_refusals = self._new_refusals, []
        return out

    def _refuse(self, path: str) -> None:
        if path in self._refused_paths:
            return
        self._refused_paths.add(path)
        self.refused += 1
        roots = ", ".join(str(r) for r in self.roots) or "none known yet"
        why = f"not inside the checkpoint root(s) of this node ({roots})"
        log.warning("refusing to pin %r: %s", path, why)
        self._new_refusals.append((path, why))

    def set(self, purpose: str, paths: Iterable[str], reason: str) -> bool:
        """Make ``purpose`` hold exactly ``paths``; returns whether anything changed.

        A path outside the roots is refused.  A path that is not a directory here (not written
        yet, or not visible on this node) is not held: the next call tries again."""
        before = self.paths()
        old = self.held.get(purpose, set())
        new: set[str] = set()
        for path in paths:
            if not self.allowed(path):
                self._refuse(path)
                continue
            if path in old or path in before:
                new.add(path)  # already marked (by this or another purpose)
                continue
            if _write_pin(Path(path), reason):
                new.add(path)
        self.held[purpose] = new
        for path in before - self.paths():  # held before, by nobody now
            if self.allowed(path):  # a pin of an older agent outside the roots: left alone
                with contextlib.suppress(OSError):
                    (Path(path) / PIN_FILE).unlink(missing_ok=True)
        changed = new != old
        if changed:
            log.info("checkpoints pinned for %s: %s", purpose, sorted(new) or "none")
        return changed


def _write_pin(target: Path, reason: str) -> bool:
    """Write ``target/PINNED``; never through a symlink (O_NOFOLLOW), never into a file that
    is not a directory's."""
    try:
        if not target.is_dir():
            return False
        fd = os.open(target / PIN_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                     0o644)
        with os.fdopen(fd, "w") as f:
            f.write(f"{reason}\n")
    except OSError as e:
        log.warning("could not pin %s: %s", target, e)
        return False
    return True

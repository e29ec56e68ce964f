"""Pins on checkpoints: the ``PINNED`` marker file that the workers' retention honours
(``agent.worker.Checkpointer.apply_retention`` never deletes a pinned checkpoint).

The agent pins for two purposes: the target of the restart it is applying (``restart``), and
what the supervisor says to protect (``protect``: the last good checkpoint before an open
incident, the target of a pending rollback).  A marker this agent wrote is removed once no
purpose holds its checkpoint any more; markers somebody else wrote (``ckpt.pin``) are left
alone.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from agent.protocol import PIN_FILE

log = logging.getLogger(__name__)


class CheckpointPins:
    def __init__(self, saved: Mapping[str, Any] | None = None) -> None:
        self.held: dict[str, set[str]] = {}
        for purpose, paths in (saved or {}).items():
            if isinstance(paths, list):
                self.held[str(purpose)] = {str(p) for p in paths if isinstance(p, str)}

    def state(self) -> dict[str, list[str]]:
        """What to persist (an agent restarted later lifts its predecessor's pins in time)."""
        return {k: sorted(v) for k, v in self.held.items() if v}

    def paths(self) -> set[str]:
        return set().union(*self.held.values()) if self.held else set()

    def set(self, purpose: str, paths: Iterable[str], reason: str) -> bool:
        """Make ``purpose`` hold exactly ``paths``; returns whether anything changed.

        A path that is not a directory here (not written yet, or not visible on this node) is
        not held: the next call tries again."""
        before = self.paths()
        old = self.held.get(purpose, set())
        new: set[str] = set()
        for path in paths:
            target = Path(path)
            if path in old or path in before:
                new.add(path)  # already marked (by this or another purpose)
                continue
            try:
                if not target.is_dir():
                    continue
                (target / PIN_FILE).write_text(f"{reason}\n")
            except OSError as e:
                log.warning("could not pin %s: %s", path, e)
                continue
            new.add(path)
        self.held[purpose] = new
        for path in before - self.paths():  # held before, by nobody now
            with contextlib.suppress(OSError):
                (Path(path) / PIN_FILE).unlink(missing_ok=True)
        changed = new != old
        if changed:
            log.info("checkpoints pinned for %s: %s", purpose, sorted(new) or "none")
        return changed

"""Figures as people read them (standard library only): the goodput explanations and the
command-line tables use the same wording."""

from __future__ import annotations


def duration(s: float | None) -> str | None:
    """Seconds as a short human duration: 42 s, 30.0 min, 9.3 h (None stays None)."""
    if s is None:
        return None
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"

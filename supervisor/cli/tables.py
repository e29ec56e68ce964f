"""Plain-text tables for the command-line tools (standard library only: ``trainwarden plan``
prints them where only the agent is installed).

Every cell goes through ``printable``: text stored by agents and operators (node names, paths,
reasons) may hold escape sequences, which must not retitle, clear or rewrite the terminal."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

# C0 controls (tab and newline included: a cell is one line), DEL, C1 controls (0x9b is CSI
# on its own), and the Unicode direction overrides that reorder what the eye reads.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(value: Any) -> str:
    """``value`` as text with every control character shown escaped (``ESC`` as ``\\x1b``):
    the escape sequence it began is then inert text."""
    return _CONTROL.sub(_escape, str(value))


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"




def table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    cells = [[printable(h) for h in header]] + [["-" if c is None else printable(c)
                                                 for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
             for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)

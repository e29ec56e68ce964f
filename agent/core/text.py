"""The one rule for untrusted text: what a worker, an agent or a client sends as free text
(a worker's last words, an event's message, a command's result, the strings inside an
event's details) before it reaches a store, a page, a log or a tick.

Free text is evidence, so it is kept, made harmless rather than refused: a crash report
refused because the dying worker wrote a NUL to its stderr would lose the crash.

* NUL, the C0 controls (tab, newline and carriage return kept where text may span lines),
  DEL and the C1 controls are shown as escapes (``\\x00``, ``\\x1b``): a store cannot hold
  a NUL (Postgres text), and an escape sequence must not rewrite a terminal or a log;
* a lone surrogate (U+D800-U+DFFF, which no UTF-8 encoder accepts) becomes U+FFFD;
* text over its bound is cut, with a marker saying how much was cut.

Identifiers (run and node names, paths, event names) are not cleaned but refused: cleaning
one would name something else.  The supervisor's wire types apply both rules where a request
enters; the agent cleans what it forwards from its workers with ``clean`` too, so none of its
batches is refused for what a worker wrote.
"""

from __future__ import annotations

import re
from typing import Any

# Controls of one-line text (names, short labels): every C0 control, DEL, every C1 control.
LINE_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")
# Controls of free text: the same, except tab, newline and carriage return.
TEXT_CONTROLS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
_SURROGATE = re.compile(r"[\ud800-\udfff]")

MAX_TEXT = 16_384  # a message, a reason, a command's result
MAX_KEY = 200  # a key of a details object
MAX_DEPTH = 16  # nesting of a details object (deeper values are replaced by a marker)
DEPTH_MARKER = "[nested too deep]"


def _escape(m: re.Match[str]) -> str:
    return f"\\x{ord(m.group()):02x}"


def cut_marker(n: int) -> str:
    return f"... [{n} characters cut]"


def clean(value: str, max_length: int = MAX_TEXT, *, multiline: bool = True) -> str:
    """``value`` made harmless: controls escaped, lone surrogates replaced, cut to
    ``max_length`` characters (a marker at the end says how many were cut)."""
    if _SURROGATE.search(value):
        value = _SURROGATE.sub("\ufffd", value)
    value = (TEXT_CONTROLS if multiline else LINE_CONTROLS).sub(_escape, value)
    if len(value) > max_length:
        room = max(0, max_length - len(cut_marker(len(value))))
        value = (value[:room] + cut_marker(len(value) - room))[:max_length]
    return value


def without_surrogates(value: Any) -> Any:
    """A JSON value with every lone surrogate in its strings (keys included) replaced by
    U+FFFD, and nothing else changed: the agent forwards what its workers send through it,
    since a supervisor cannot read a batch holding one (it is not UTF-8) and would refuse
    the whole batch."""
    if isinstance(value, str):
        # (every step report passes here: plain ASCII, the common case, is not scanned)
        if value.isascii() or not _SURROGATE.search(value):
            return value
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {without_surrogates(k): without_surrogates(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [without_surrogates(v) for v in value]
    return value


def is_clean(value: str, *, multiline: bool = True) -> bool:
    """Whether ``clean`` would leave ``value``'s characters as they are."""
    controls = TEXT_CONTROLS if multiline else LINE_CONTROLS
    return controls.search(value) is None and _SURROGATE.search(value) is None


def clean_json(value: Any, max_length: int = MAX_TEXT, _depth: int = 0) -> Any:
    """A JSON value with every string in it (keys included) cleaned; containers nested deeper
    than ``MAX_DEPTH`` are replaced by a marker.  Numbers and the rest are left as they are
    (what a store cannot hold, such as NaN, is the store's to map)."""
    if isinstance(value, str):
        return clean(value, max_length)
    if isinstance(value, dict | list | tuple) and _depth >= MAX_DEPTH:
        return DEPTH_MARKER
    if isinstance(value, dict):
        return {clean(str(k), MAX_KEY, multiline=False): clean_json(v, max_length, _depth + 1)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean_json(v, max_length, _depth + 1) for v in value]
    return value

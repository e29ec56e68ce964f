"""The settings reference, generated from the model: every field with its flag, environment
variable, default and meaning (``trainwarden settings --markdown`` prints it).

The meaning of a field is the comment its config class gives it, where the field is declared
(the trailing comment on its line, else the comment lines right above it): the one place a
field is described is next to its default, in the component that owns it.
"""

from __future__ import annotations

import functools
import inspect
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

from trainwarden.supervisor.config import Setting, settings_fields


@dataclass(frozen=True)
class Row:
    name: str  # section.field
    flag: str
    env: str
    also: list[str]  # older names of the same setting (environment variables)
    default: str
    meaning: str


_FIELD = re.compile(r"^(\s+)([a-z_][a-z0-9_]*)\s*:")


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """field name -> its comment in the source of ``cls`` (empty without a source)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return {}
    trailing: dict[int, str] = {}  # line number -> its trailing comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    indent: str | None = None
    for i, line in enumerate(lines, start=1):
        m = _FIELD.match(line)
        if not m or (indent is not None and m.group(1) != indent):
            continue
        indent = m.group(1)
        own = trailing.get(i) if not line.strip().startswith("#") else None
        if own:
            out[m.group(2)] = own
            continue
        above: list[str] = []
        j = i - 1
        while j >= 1 and lines[j - 1].strip().startswith("#"):
            above.insert(0, trailing.get(j, ""))
            j -= 1
        out[m.group(2)] = " ".join(a for a in above if a)
    return out


def _default(s: Setting) -> str:
    if s.default is None:
        return "unset"
    if isinstance(s.default, Path):
        return str(s.default)
    if isinstance(s.default, bool):
        return "true" if s.default else "false"
    if isinstance(s.default, float):
        return f"{s.default:g}"
    return str(s.default)


def _meaning(s: Setting) -> str:
    text = field_comments(s.owner).get(s.owner_field, "")
    return re.sub(r"^\.\.\.\s*", "", text).replace("...", "").strip()


def rows() -> list[Row]:
    return [Row(name=f"{s.section}.{s.name}", flag=s.flag, env=s.env, also=s.legacy,
                default=_default(s), meaning=_meaning(s)) for s in settings_fields()]


def describe(s: Setting) -> str:
    """A flag's help text."""
    meaning = _meaning(s)
    text = f"{meaning + '; ' if meaning else ''}default {_default(s)}; env {s.env}"
    if s.name.endswith("token"):
        text += " (a flag shows in the process list: prefer the environment)"
    return text


def markdown() -> str:
    """The reference as a Markdown table."""
    out = ["| setting | flag | environment | default | meaning |",
           "| --- | --- | --- | --- | --- |"]

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    for r in rows():
        env = f"`{r.env}`" + "".join(f" (or `{a}`)" for a in r.also)
        out.append(f"| `{r.name}` | `{r.flag}` | {env} | `{cell(r.default)}` | "
                   f"{cell(r.meaning)} |")
    return "\n".join(out) + "\n"

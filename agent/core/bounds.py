"""Config validation, declared where each field is declared, with one error style.

A config dataclass gives each bounded field its bound next to its default and calls
``check(self)`` in ``__post_init__``::

    @dataclass(frozen=True)
    class HangConfig:
        SECTION: ClassVar[str] = "hang"  # errors name hang.<field>

        k: float = bounded(8.0, gt=0, hint="try 8")  # x p99 of recent step intervals
        mtbf_s: float = field(metadata=bound(gt=0))  # a field without a default

        def __post_init__(self) -> None:
            check(self)
            cross_check(self.min_history <= self.window_steps, self, "min_history",
                        f"<= window_steps ({self.window_steps})", got=self.min_history)

Every refusal reads ``<section>.<field> must be <bound> (got <value>)[; <hint>]``, where
``<section>`` is the name the user sets the field by: the class's ``SECTION`` (the settings
section; a function of the field's name where one class feeds several sections), else the
class name.  A rule between fields is a ``cross_check`` in the same words.

NaN fails every numeric bound (each is written as the comparison that must hold).  A field
whose default is ``None`` may be ``None`` (unset); any other value is held to the bound.
Standard library only: the agent's core and the supervisor's pure detectors both use it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# The dataclass field metadata key of a bound.  Not a pydantic ``Field`` argument, so pydantic
# (which reads the settings sections' dataclasses) leaves it alone.
BOUND_KEY = "trainwarden_bound"

_NOT_GIVEN: Any = object()


def _num(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


@dataclass(frozen=True)
class Bound:
    """What a field's value must be.  ``ge``/``gt``/``le``/``lt``: numeric limits;
    ``finite``: not infinite (NaN fails any bound); ``integer``: an ``int`` (not a bool);
    ``one_of``: one of these values; ``hint``: how to fix it (``"try 8"``)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    finite: bool = False
    integer: bool = False
    one_of: tuple[Any, ...] | None = None
    hint: str = ""

    def __post_init__(self) -> None:
        if self.ge is not None and self.gt is not None:
            raise TypeError("a bound takes ge or gt, not both")
        if self.le is not None and self.lt is not None:
            raise TypeError("a bound takes le or lt, not both")

    def holds(self, value: Any) -> bool:
        if self.one_of is not None:
            return value in self.one_of
        if self.integer and (isinstance(value, bool) or not isinstance(value, int)):
            return False
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.finite and not math.isfinite(value):
            return False
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le)
                and (self.lt is None or value < self.lt)) and value == value

    def describe(self) -> str:
        """The bound in words: ``> 0``, ``in (0, 1]``, ``an integer >= 1``, ``one of 'a', 'b'``."""
        if self.one_of is not None:
            return "one of " + ", ".join(repr(v) for v in self.one_of)
        low = ("[", self.ge) if self.ge is not None else ("(", self.gt)
        high = ("]", self.le) if self.le is not None else (")", self.lt)
        if low[1] is not None and high[1] is not None:
            limits = f"in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
        elif low[1] is not None:
            limits = f"{'>=' if low[0] == '[' else '>'} {_num(low[1])}"
        elif high[1] is not None:
            limits = f"{'<=' if high[0] == ']' else '<'} {_num(high[1])}"
        else:
            limits = ""
        kind = "an integer" if self.integer else "a finite number" if self.finite else ""
        return " ".join(p for p in (kind, limits) if p) or "a number"


def bound(*, ge: float | None = None, gt: float | None = None, le: float | None = None,
          lt: float | None = None, finite: bool = False, integer: bool = False,
          one_of: tuple[Any, ...] | None = None, hint: str = "") -> Mapping[str, Bound]:
    """A bound as field metadata: ``field(default_factory=..., metadata=bound(gt=0))``."""
    return {BOUND_KEY: Bound(ge=ge, gt=gt, le=le, lt=lt, finite=finite, integer=integer,
                             one_of=one_of, hint=hint)}


def bounded(default: Any, *, ge: float | None = None, gt: float | None = None,
            le: float | None = None, lt: float | None = None, finite: bool = False,
            integer: bool = False, one_of: tuple[Any, ...] | None = None,
            hint: str = "") -> Any:
    """A dataclass field with ``default`` and a bound: ``k: float = bounded(8.0, gt=0)``."""
    return dataclasses.field(default=default, metadata=bound(
        ge=ge, gt=gt, le=le, lt=lt, finite=finite, integer=integer, one_of=one_of, hint=hint))


def setting_name(config: object, field: str) -> str:
    """``section.field``: the name the user sets ``field`` of ``config`` by."""
    section: str | Callable[[str], str] | None = getattr(type(config), "SECTION", None)
    if callable(section):
        return section(field)
    return f"{section or type(config).__name__}.{field}"


def message(name: str, must: str, got: Any = _NOT_GIVEN, hint: str = "") -> str:
    """The one error style: ``name must be <must> (got <value>)[; <hint>]``."""
    text = f"{name} must be {must}"
    if got is not _NOT_GIVEN:
        text += f" (got {got!r})"
    return f"{text}; {hint}" if hint else text


def check(config: object) -> None:
    """Raise ``ValueError`` (in the one style) for the first field of ``config`` outside its
    declared bound; fields without a bound are not looked at."""
    assert dataclasses.is_dataclass(config)
    for f in dataclasses.fields(config):
        b = f.metadata.get(BOUND_KEY)
        if b is None:
            continue
        value = getattr(config, f.name)
        if value is None and f.default is None:
            continue
        if not b.holds(value):
            raise ValueError(message(setting_name(config, f.name), b.describe(), value, b.hint))


def cross_check(ok: bool, config: object, field: str, must: str, *, got: Any = _NOT_GIVEN,
                hint: str = "") -> None:
    """A rule between fields, in the same style: unless ``ok``, raise
    ``ValueError("<section>.<field> must be <must> (got <got>); <hint>")`` (leave ``got`` out
    where the value must not be shown, a token)."""
    if not ok:
        raise ValueError(message(setting_name(config, field), must, got, hint))

"""The declarative config bounds: each bound kind, the one error text, fields without a bound
left alone, NaN refused."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pytest

from trainwarden.agent.core.bounds import (
    Bound,
    bound,
    bounded,
    check,
    cross_check,
    message,
    setting_name,
)


@dataclass(frozen=True)
class Demo:
    SECTION: ClassVar[str] = "demo"

    positive: float = bounded(1.0, gt=0, hint="try 1")
    count: int = bounded(1, ge=1)
    share: float = bounded(0.5, gt=0, lt=1)
    quantile: float = bounded(0.9, ge=0.5, le=1)
    ceiling: float = bounded(0.0, le=10)
    below: float = bounded(0.0, lt=10)
    seconds: float = bounded(1.0, gt=0, finite=True)
    whole: int = bounded(1, ge=1, integer=True)
    mode: str = bounded("a", one_of=("a", "b"))
    optional: int | None = bounded(None, ge=1)
    free: float = 0.0  # no bound: never looked at
    required: float = field(default=2.0, metadata=bound(ge=2))

    def __post_init__(self) -> None:
        check(self)
        cross_check(self.count <= 100, self, "count", "<= 100", got=self.count,
                    hint="lower count")


@dataclass(frozen=True)
class NoSection:
    x: float = bounded(1.0, gt=0)

    def __post_init__(self) -> None:
        check(self)


def _named(f: str) -> str:
    return "restart.budget" if f == "restart_budget" else f"rollback.{f}"


@dataclass(frozen=True)
class SplitSection:
    SECTION: ClassVar[Callable[[str], str]] = _named
    restart_budget: int = bounded(1, ge=0)

    def __post_init__(self) -> None:
        check(self)


def refused(text: str, **kw: Any) -> None:
    with pytest.raises(ValueError, match=f"^{re.escape(text)}$"):
        Demo(**kw)


def test_defaults_pass_and_a_field_without_a_bound_is_ignored() -> None:
    assert Demo().positive == 1.0
    assert Demo(free=-math.inf).free == -math.inf
    assert Demo(free=math.nan, optional=None).optional is None


@pytest.mark.parametrize("kw, text", [
    ({"positive": 0}, "demo.positive must be > 0 (got 0); try 1"),
    ({"count": 0}, "demo.count must be >= 1 (got 0)"),
    ({"share": 1.0}, "demo.share must be in (0, 1) (got 1.0)"),
    ({"quantile": 0.4}, "demo.quantile must be in [0.5, 1] (got 0.4)"),
    ({"ceiling": 10.5}, "demo.ceiling must be <= 10 (got 10.5)"),
    ({"below": 10}, "demo.below must be < 10 (got 10)"),
    ({"seconds": math.inf}, "demo.seconds must be a finite number > 0 (got inf)"),
    ({"whole": 2.0}, "demo.whole must be an integer >= 1 (got 2.0)"),
    ({"whole": True}, "demo.whole must be an integer >= 1 (got True)"),
    ({"mode": "c"}, "demo.mode must be one of 'a', 'b' (got 'c')"),
    ({"optional": 0}, "demo.optional must be >= 1 (got 0)"),
    ({"required": 1}, "demo.required must be >= 2 (got 1)"),
    ({"count": "3"}, "demo.count must be >= 1 (got '3')"),
    ({"count": 101}, "demo.count must be <= 100 (got 101); lower count"),
])
def test_each_bound_kind_refuses_in_one_style(kw: dict[str, Any], text: str) -> None:
    refused(text, **kw)


@pytest.mark.parametrize("name", ["positive", "share", "quantile", "ceiling", "below",
                                  "seconds", "required"])
def test_nan_fails_every_numeric_bound(name: str) -> None:
    with pytest.raises(ValueError, match=rf"^demo\.{name} must be .* \(got nan\)"):
        Demo(**{name: math.nan})


def test_none_passes_only_where_it_is_the_default() -> None:
    with pytest.raises(ValueError, match=r"demo\.count must be >= 1 \(got None\)"):
        Demo(count=None)  # type: ignore[arg-type]


def test_the_section_is_the_class_name_or_a_function_of_the_field() -> None:
    with pytest.raises(ValueError, match=r"^NoSection\.x must be > 0 \(got -1\)$"):
        NoSection(x=-1)
    with pytest.raises(ValueError, match=r"^restart\.budget must be >= 0 \(got -1\)$"):
        SplitSection(restart_budget=-1)
    assert setting_name(Demo(), "count") == "demo.count"
    assert setting_name(SplitSection(), "lr_scale") == "rollback.lr_scale"


def test_a_cross_check_can_leave_the_value_out() -> None:
    with pytest.raises(ValueError, match=r"^demo\.token must be different; choose another$"):
        cross_check(False, Demo(), "token", "different", hint="choose another")
    cross_check(True, Demo(), "token", "different")
    assert message("a.b", "> 0", 0) == "a.b must be > 0 (got 0)"


def test_a_bound_takes_one_lower_and_one_upper_limit() -> None:
    with pytest.raises(TypeError):
        Bound(ge=0, gt=0)
    with pytest.raises(TypeError):
        Bound(le=0, lt=0)
    assert Bound(integer=True).describe() == "an integer"
    assert Bound(finite=True, ge=0).describe() == "a finite number >= 0"

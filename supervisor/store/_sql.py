"""Helpers shared by the store modules (not part of the store's interface)."""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import ColumnElement, Connection, Table, case
from sqlalchemy.dialects import postgresql, sqlite


def insert(conn: Connection, table: Table) -> Any:
    """Dialect insert (both SQLite and Postgres support ON CONFLICT)."""
    if conn.dialect.name == "postgresql":
        return postgresql.insert(table)
    return sqlite.insert(table)


def least(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
    # Portable NULL-ignoring min of two values (SQLite's min(a, b) is NULL if either is).
    return case((a.is_(None), b), (b.is_(None), a), (a <= b, a), else_=b)


def greatest(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((a.is_(None), b), (b.is_(None), a), (a >= b, a), else_=b)


def nsum(a: ColumnElement[Any], b: ColumnElement[Any]) -> ColumnElement[Any]:
    return case((a.is_(None), b), (b.is_(None), a), else_=a + b)


def row(r: Any) -> dict[str, Any]:
    return dict(r._mapping)


def split_float(x: float | None) -> tuple[float | None, str | None]:
    """A float as (finite value or None, "nan"/"inf"/"-inf" or None): SQLite drops NaN."""
    if x is None or math.isfinite(x):
        return x, None
    if math.isnan(x):
        return None, "nan"
    return None, "inf" if x > 0 else "-inf"


def join_float(value: float | None, special: str | None) -> float | None:
    if special is None:
        return value
    # (an unknown marker, which only a damaged row holds: the stored value stands)
    return {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}.get(special, value)


def with_specials(d: dict[str, Any]) -> dict[str, Any]:
    """A per-rank row with its NaN/Inf loss and grad norm put back (see ``split_float``)."""
    d["loss"] = join_float(d["loss"], d.pop("loss_special"))
    d["grad_norm"] = join_float(d["grad_norm"], d.pop("grad_norm_special"))
    return d


def finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def json_safe(obj: Any) -> Any:
    """JSON columns cannot hold NaN on every backend: non-finite floats become strings."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj

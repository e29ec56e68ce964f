"""Small robust statistics over plain sequences (no numpy: windows are short, calls frequent)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence


def median_sorted(xs: Sequence[float]) -> float:
    """Median of an already sorted, non-empty sequence."""
    n = len(xs)
    if n == 0:
        raise ValueError("median of an empty sequence")
    m = n // 2
    return xs[m] if n % 2 else (xs[m - 1] + xs[m]) / 2.0


def median(xs: Iterable[float]) -> float:
    return median_sorted(sorted(xs))


def quantile(xs: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation between order statistics."""
    s = sorted(xs)
    if not s:
        raise ValueError("quantile of an empty sequence")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)

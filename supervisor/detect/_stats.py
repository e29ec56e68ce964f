"""Small robust statistics over plain sequences (no numpy: windows are short, calls frequent)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

# MAD x 1.4826 estimates the standard deviation of normally distributed data.
MAD_TO_SIGMA = 1.4826


def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def median_sorted(xs: Sequence[float]) -> float:
    """Median of an already sorted, non-empty sequence."""
    n = len(xs)
    if n == 0:
        raise ValueError("median of an empty sequence")
    m = n // 2
    return xs[m] if n % 2 else (xs[m - 1] + xs[m]) / 2.0


def median(xs: Iterable[float]) -> float:
    return median_sorted(sorted(xs))


def mad(xs: Sequence[float], center: float) -> float:
    """Median absolute deviation around ``center``."""
    return median(abs(x - center) for x in xs)


def quantile(xs: Iterable[float], q: float) -> float:
    """The ``q`` quantile (0..1) with linear interpolation between order statistics."""
    s = sorted(xs)
    if not s:
        raise ValueError("quantile of an empty sequence")
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median_excluding(sorted_xs: Sequence[float], i: int) -> float:
    """Median of ``sorted_xs`` without the element at index ``i`` (needs len >= 2)."""
    n = len(sorted_xs) - 1
    if n < 1:
        raise ValueError("median_excluding needs at least two values")

    def at(j: int) -> float:  # j-th element of the list with index i removed
        return sorted_xs[j if j < i else j + 1]

    m = n // 2
    return at(m) if n % 2 else (at(m - 1) + at(m)) / 2.0


def require(ok: bool, message: str) -> None:
    """Config validation: raise ``ValueError(message)`` unless ``ok``."""
    if not ok:
        raise ValueError(message)

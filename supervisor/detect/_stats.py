"""Small robust statistics over plain sequences (no numpy: windows are short, calls frequent).

The ones the agent's hang watchdog needs too live in the shared core
(``trainwarden.agent.core.stats``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainwarden.agent.core.stats import median, median_sorted, quantile

__all__ = ["MAD_TO_SIGMA", "is_finite", "mad", "median", "median_excluding", "median_sorted",
           "quantile"]

# MAD x 1.4826 estimates the standard deviation of normally distributed data.
MAD_TO_SIGMA = 1.4826


def is_finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def mad(xs: Sequence[float], center: float) -> float:
    """Median absolute deviation around ``center``."""
    return median(abs(x - center) for x in xs)


def median_excluding(sorted_xs: Sequence[float], i: int) -> float:
    """Median of ``sorted_xs`` without the element at index ``i`` (needs len >= 2)."""
    n = len(sorted_xs) - 1
    if n < 1:
        raise ValueError("median_excluding needs at least two values")

    def at(j: int) -> float:  # j-th element of the list with index i removed
        return sorted_xs[j if j < i else j + 1]

    m = n // 2
    return at(m) if n % 2 else (at(m - 1) + at(m)) / 2.0

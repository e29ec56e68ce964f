"""The one way a test waits: poll a condition until it holds, with a deadline (never a bare
sleep that hopes a race away)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(cond: Callable[[], T], timeout: float = 10.0, what: str = "condition",
             interval: float = 0.02) -> T:
    """Poll ``cond`` every ``interval`` seconds until it returns something truthy, and return
    that; fail the test, naming ``what``, once ``timeout`` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)

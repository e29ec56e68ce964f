"""The clock every component of the supervisor is given: a function returning Unix time.

Components take it as an argument (``time.time`` in production) so that tests drive time with
a fake one; it lives on its own so that any layer may name the type without importing another.
"""

from __future__ import annotations

from collections.abc import Callable

Clock = Callable[[], float]

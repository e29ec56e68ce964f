"""Where a run's time goes: pure accounting and advice, no I/O (standard library only).

* ``ettr``: effective training time ratio with the badput by cause, accumulated
  incrementally from a run's events.
"""

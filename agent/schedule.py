"""When a node agent's next batch is due: on the agent's own phase of the batch interval.

Batches go at the slot boundaries ``t = (k - phase) * interval`` (``phase`` in [0, 1), drawn
once per agent), not one interval after the previous batch.  The difference matters the
moment a supervisor asks every agent for a longer interval (backpressure): they all read the
advice within the same second, and "one interval after my last batch" would keep them within
that second of each other, every agent of a 2,048-node run in one second out of four, a
burst four times the request rate the advice was sized for.  With each agent on its own
phase the batches spread evenly over the interval from the first slot after the change
(which may come sooner than a whole interval: one batch a little early, never a batch
late), whatever the agents did before.
"""

from __future__ import annotations

import math


def batch_due(*, now: float, last: float, interval_s: float, phase: float) -> bool:
    """True when a slot boundary of ``interval_s`` (shifted by ``phase`` of it) lies in
    ``(last, now]``: a batch is due.  ``last`` is when the previous batch went (``-inf``:
    none yet, due at once).  A clock that stepped back behind ``last`` (NTP correcting a
    wall clock) makes a batch due at once too: waiting for the clock to pass ``last`` again
    would silence the node's heartbeats for as long as the step, and a silent node is lost."""
    if math.isinf(last) or now < last:
        return True
    return math.floor(now / interval_s + phase) > math.floor(last / interval_s + phase)

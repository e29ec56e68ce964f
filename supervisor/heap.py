"""The garbage collector's schedule in the supervisor's long-lived processes.

CPython's cyclic collector walks every tracked object of the generations it collects, and
a full collection runs whenever a quarter as many objects again as the last one kept have
reached the old generation.  A supervisor under load keeps hundreds of thousands of
objects that never die (modules, the app, the ORM's metadata, one protocol per agent
connection) and promotes each in-flight request's objects to the old generation at every
young collection that catches them alive, so under heavy ingest full collections come every
few seconds, each stopping the event loop long enough to show in ingest latency: every batch
that arrives during one waits.

``settle`` runs once startup is done: the objects alive then are frozen (never walked
again), and a young collection waits for 10,000 more tracked objects than died instead of
700, so requests in flight are rarely caught and promoted.  Cyclic garbage is still
collected: a young collection still runs for each 10,000 objects a process keeps, and the
older generations at their usual ratios.
"""

from __future__ import annotations

import gc

YOUNG_OBJECTS = 10_000  # net new tracked objects before a young collection (CPython: 700)


def settle() -> int:
    """Freeze what startup left alive and widen the young generation; returns how many
    objects were frozen."""
    gc.collect()  # garbage of the startup is freed, not frozen for good
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_OBJECTS, middle, old)
    return gc.get_freeze_count()

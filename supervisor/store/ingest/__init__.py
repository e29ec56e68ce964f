"""The ingest hot path: agent batches into the store, and the commands each reply carries.

Written for throughput: one transaction per group of batches (the caller's), multi-row VALUES
statements run on the DBAPI cursor, rows pre-reduced in Python so each upsert touches a key
once, and the contended per-step aggregate upsert placed last so its row lock (Postgres) is
held only until the commit.

* ``batches``: ``ingest_batches``, the orchestration of one group, and its outcomes;
* ``collect``: a batch's items turned into rows, merged across the group, and written;
* ``statements``: the compiled statements and the multi-row runner (``HotSQL``);
* ``clock``: agent timestamps against the supervisor's clock (``IngestConfig``);
* ``commands``: the pending commands each reply carries, and the agents' results.
"""

from trainwarden.supervisor.store.ingest.batches import (
    CheckpointRefused,
    IngestResult,
    Outcome,
    SeqConflict,
    UnknownAgent,
    ingest_batch,
    ingest_batches,
)
from trainwarden.supervisor.store.ingest.clock import CLOCK_SKEW_EVENT_S, IngestConfig

__all__ = ["CLOCK_SKEW_EVENT_S", "CheckpointRefused", "IngestConfig", "IngestResult", "Outcome",
           "SeqConflict", "UnknownAgent", "ingest_batch", "ingest_batches"]

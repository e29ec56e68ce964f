"""trainwarden supervisor: the central service that stores what the node agents report, decides
(policy) and sends commands back.

Layout: ``config`` (settings: one section per component; ``settings_reference`` prints
them), ``enums`` (statuses and kinds), ``store/`` (models, engines, every SQL statement by
concern), ``wire`` (request models mirroring ``trainwarden.agent.protocol``), ``api/`` (routes and
dependencies), ``ingest`` (group-commit writer, Postgres), ``detect/`` (the detectors; the hang
statistic is in the shared core, ``trainwarden.agent.core``), ``observe`` (their windows),
``policy`` (the
one place that decides), ``actions`` (decisions -> audited rows and commands), ``evaluator``
(tick: store -> policy -> actions), ``migrate`` (Alembic), ``app`` (create_app), ``serve`` and
``cli``.

Design choices worth knowing (measured, see ``benchmarks/ingest.py``):

* Ingest is idempotent by (agent_id, seq) with the key claimed inside the batch's transaction
  (``INSERT .. ON CONFLICT DO NOTHING RETURNING``): a replay stores nothing, even when it
  races the original.
* The hot ingest path builds its statements with SQLAlchemy once and runs them on the DBAPI
  cursor as multi-row VALUES statements; SQLAlchemy's per-execute overhead was larger than
  SQLite's own work.
* SQLite writes run inline on the event loop under a process-wide lock (no thread hop, no
  busy-handler sleeps); Postgres batches go through one writer thread that commits whatever
  queued up as one transaction (every agent of a run updates the same per-step aggregate row,
  so concurrent transactions would queue on its row lock).
* A NaN loss survives storage: float columns that may be non-finite have a ``*_special``
  companion ("nan", "inf", "-inf"); the API writes them as the strings "NaN"/"Infinity".
* A gang restart moves the run to the next attempt at once, so the peers' failure reports for
  the old attempt are late by construction: one crash, one incident, one restart.
"""

"""trainwarden supervisor: the central service that stores what the node agents report, decides
(policy) and sends commands back.

Layout, one folder per concern:

* ``config`` (the settings model: one section per component's own config) and ``enums``
  (statuses, kinds, event names), used throughout;
* ``contract/``: the HTTP contract with the agents (wire models, bounds, checkpoint paths);
* ``api/``: the routes under ``/api/v1`` and their dependencies;
* ``ingest/``: the ingest fast path, the group-commit writer, delivery observation;
* ``control/``: the control loop (evaluator, detection windows, observer, policy, actions,
  leadership, retention);
* ``detect/`` and ``goodput/``: pure statistics and accounting, no I/O;
* ``store/``: every SQL statement, by concern, and the migrations driver;
* ``observability/``: the Prometheus collector and the efficiency figures;
* ``dashboard/``: the HTML pages;
* ``server/``: the app, uvicorn, HTTP hardening, the GC schedule;
* ``cli/``: the ``trainwarden`` console script and its API clients.

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

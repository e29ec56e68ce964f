"""Ingest: how the agents' batches get into the store.

* ``fast_path``: ``POST /api/v1/ingest`` answered ahead of the middleware stack;
* ``writer``: the group-commit writer (one transaction for whatever queued up meanwhile);
* ``delivery``: what the supervisor observes of its own delivery (batch lateness, event-loop
  lag), the inputs of ``trainwarden.supervisor.detect.overload``.

The SQL they run is ``trainwarden.supervisor.store.ingest``.
"""

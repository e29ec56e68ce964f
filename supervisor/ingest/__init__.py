"""Ingest: how the agents' batches get into the store.

* ``writer``: the group-commit writer (one transaction for whatever queued up meanwhile);
* ``delivery``: what the supervisor observes of its own delivery (batch lateness, event-loop
  lag), the inputs of ``trainwarden.supervisor.detect.overload``.

The SQL they run is ``trainwarden.supervisor.store.ingest``; the route that feeds them is
``trainwarden.supervisor.api.agents`` (answered ahead of the middleware stack by
``trainwarden.supervisor.server.ingest_path``).
"""

"""What the supervisor shows of a run outside the dashboard's pages.

* ``metrics``: the Prometheus collector that reads the store at scrape time, and the
  supervisor's own request metrics;
* ``efficiency``: the restart anatomy, checkpoint-interval advice and MFU read from the
  store into the pure ``trainwarden.supervisor.goodput`` modules (one computation for the API,
  the dashboard and ``/metrics``).
"""

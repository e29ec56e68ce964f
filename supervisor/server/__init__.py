"""The server process: the app, its HTTP hardening and how it runs.

* ``app``: ``create_app`` (routes, dashboard, metrics, the ingest fast path, lifespan);
* ``serve``: the ``trainwarden supervisor`` command's body (uvicorn);
* ``httpguard``: read deadlines for slow or silent clients;
* ``headers``: the security headers on every response;
* ``heap``: the garbage collector's schedule for the long-lived processes.
"""

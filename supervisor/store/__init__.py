"""Persistence: every SQL statement of the supervisor lives in this package.

``models`` (the schema, owned by the Alembic migrations) and ``tables`` (its Core handles);
``db`` (engines, the write lock, the ``Connection`` type the rest of the supervisor passes
around); ``rows`` (the typed rows the readers return).  The statements, by concern, as
keyword-only functions taking a ``Connection``:

* ``ingest``: the hot path (agent batches in, pending commands out with each reply);
* ``registry``: runs and agents (registration, run status);
* ``credentials``: each agent's credential digest, who holds a (run, node), takeovers;
* ``tokens``: the stored tokens with roles;
* ``recovery``: exits, incidents, audited actions and commands, the checkpoint lineage;
* ``windows``: the measurements the detectors judge every tick
  (``trainwarden.supervisor.control.detection``);
* ``reads``: what the API, the dashboard and the metrics collector show;
* ``hosts``: the per-node health ledger (each node's state, the evidence against it, every
  cordon and uncordon, audited).

``_sql`` holds helpers the modules share.
"""

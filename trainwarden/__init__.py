"""trainwarden: a fault-tolerant supervisor for long distributed PyTorch training runs.

One import root, three parts:

* ``trainwarden.supervisor``: the central service (API, ingest, the evaluation loop, the
  store, the dashboard, ``/metrics``, the ``trainwarden`` command); extra ``[supervisor]``;
* ``trainwarden.agent``: the node agent that wraps torchrun, and ``trainwarden.agent.worker``,
  the in-training library a training script imports (``import trainwarden.agent.worker as
  tw``); extra ``[agent]``; ``trainwarden.agent.integrations`` holds the Hugging Face and
  Lightning callbacks;
* ``trainwarden.agent.core``: the pure pieces both sides share (standard library only).

Nothing is imported here: importing the root costs nothing, and neither part pulls in the
other's dependencies.
"""

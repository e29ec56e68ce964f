"""Batches to the supervisor: sequence numbers, spool, in-order replay, commands back.

The main loop calls ``enqueue`` (cheap: a file write) and never touches the network.  A sender
thread (or, in tests, explicit ``pump`` calls) registers, then posts the spooled batches oldest
first.  Outcomes per batch:

- 2xx: delivered; the reply's commands are queued for the executor.
- connection error, timeout, 502/503/504 (the supervisor or its proxy is down or full),
  401/403 (token trouble is not the batch's fault), 408, 429: the batch stays first in line
  and the sender backs off (0.5 s doubling to 10 s).  Nothing is set aside for these: a wrong
  token or an outage must not throw away the run's data.  With several supervisor addresses
  (the replicas of one supervisor on a shared Postgres), a connection error, timeout or
  502/503/504 moves the sender to the next address at once, the same batch first in line
  (registration, the credential and the sequence numbers are the shared store's, so nothing
  else changes); the backoff applies once every address failed in a row.  A batch an
  address stored but whose reply was lost is sent again to the next: the supervisor answers
  it as a duplicate of its (agent, seq), so delivery stays at-least-once, stored once.
- 404: the supervisor does not know this agent (its database was reset): register again.
- 403 with ``X-Trainwarden-Credential: invalid``: the supervisor no longer takes this
  agent's credential (a newer registration of the node, an operator's takeover): register
  again, presenting it (the batch stays first in line).
- registration answered 409 with ``Retry-After``: another agent holds the node and was
  heard from recently (say, this agent's state dir was lost and its previous incarnation
  is still alive): retried with backoff until the supervisor calls that one lost.
- registration answered 409 otherwise: the run has ended (completed, failed, stopped), or
  an operator took the node over; nothing is sent any more (``refused`` says why) and the
  agent ends.

Every request carries the agent's credential (``X-Trainwarden-Agent-Credential``, the
secret the registration returned, kept in ``uplink.json`` beside the sequence numbers): it
is what tells the supervisor a batch is this agent's, and re-registering with it keeps the
node through an agent restart.
- a registration whose run uuid is not the local state's (``check_identity``): nothing is
  sent (``foreign`` holds the reply) until the agent has archived that state and built a new
  uplink on a fresh one; another run's spooled batches never reach this run.
- any other 4xx: final, the batch itself is bad.  It is set aside in the dead-letter store
  (``dead-letter/``, with the reply) and the queue moves on.  So is a 409, the supervisor's
  answer to a seq it already stored with different content: resending cannot store it under
  that seq, and it is not renumbered on a guess (a second agent posting under our id, or our
  numbering gone back, is for a human to see in the dead-letter store and the event).
- any other 5xx: retried with backoff.  After ``max_5xx_tries`` tries in a row the batch
  steps out of line and the newer batches go on.  If a newer batch is accepted, the suspect
  gets one last try and, failing again, is set aside like a 4xx; if the newer batches fail
  too, the server is at fault, not the batch, and it goes back to the head of the line.  So a
  batch that breaks the supervisor never blocks the batches (and heartbeats) behind it, and an
  outage never dead-letters anything.

The supervisor checks every checkpoint path against the roots of the agent's newest
registration: when the agent learns a new root (its workers report a checkpoint elsewhere),
``update_registration`` has the sender register again before the next batch.  Refused (4xx),
the registration held stands and sending goes on.

Every batch set aside is announced to the supervisor by a ``batch_dead_lettered`` event in
the next batch spooled (seq, status, reason, and the count so far), so it shows there.

Sequence numbers are per agent and persisted in ``uplink.json`` before the batch is written,
so they only ever grow across agent restarts; registration raises them to the supervisor's
``next_seq`` when our state was lost.  The supervisor stores batches in any order, so a batch
that stepped out of line can still be delivered later.

One module a seam, each a part of the one ``Uplink``: ``base`` (the defaults, the client,
the state file, the backoff and failover), ``registration``, ``delivery`` (one batch and
what its answer means, the reply's commands), ``sender`` (the main loop's side and the
sending pass).
"""

from __future__ import annotations

from trainwarden.agent.uplink.base import (
    HTTP_TIMEOUT_S,
    INGEST_PATH,
    MAX_5XX_TRIES,
    MAX_ADVISED_INTERVAL_S,
    MAX_ITEMS_PER_BATCH,
    REGISTER_PATH,
    SPOOL_MAX_BATCHES,
    SPOOL_MAX_BYTES,
    advised_interval,
)
from trainwarden.agent.uplink.sender import Uplink

__all__ = [
    "HTTP_TIMEOUT_S",
    "INGEST_PATH",
    "MAX_5XX_TRIES",
    "MAX_ADVISED_INTERVAL_S",
    "MAX_ITEMS_PER_BATCH",
    "REGISTER_PATH",
    "SPOOL_MAX_BATCHES",
    "SPOOL_MAX_BYTES",
    "Uplink",
    "advised_interval",
]

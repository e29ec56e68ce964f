"""The agent: ``tick()`` is one iteration, ``run()`` a thin loop around it.

One tick: echo torchrun's output, drain the worker socket, notice torchrun's exit, apply
commands, and spool a batch when one is due (every ``batch_interval_s``, at the agent's own
phase of it: ``trainwarden.agent.schedule``; at once when an event, checkpoint, exit or command
result is
waiting).  The network is the uplink thread's business; a tick never waits on it.

Before launching, the agent registers (for at most ``register_wait_s``): the reply names the
run, by the uuid the supervisor gave it at creation, and the local state must belong to that
run.  A state of another run (another uuid, or one saved before runs had one: a reused run
name) is archived beside the state dir and replaced, so no worker starts at its attempt or
from its resume plan; a run that has ended refuses the registration, and nothing is launched.
A supervisor that does not answer in time delays training by that wait only: the workers
start from the local state, and a foreign state found once it answers is replaced then.

One module a part of the one ``Agent``: ``base`` (the state dir, the agent's state and its
moves, launching torchrun), ``membership`` (what the node is in its run), ``identity``
(which run the local state belongs to), ``checkpoints`` (roots and pins), ``lifecycle``
(the tick, the exit of the workers, the heartbeat, shutting down, ``run``).
"""

from __future__ import annotations

from trainwarden.agent.loop.base import (
    AGENT_VERSION,
    EXIT_REFUSED,
    UNLISTED_MOVE,
    AgentAlreadyRunning,
)
from trainwarden.agent.loop.lifecycle import Agent

__all__ = ["AGENT_VERSION", "EXIT_REFUSED", "UNLISTED_MOVE", "Agent", "AgentAlreadyRunning"]

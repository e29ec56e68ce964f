"""The states and kinds that travel between the agent and the supervisor.

``StrEnum``: each member is its value, so they are written to the wire and to the store as
the plain strings they always were, and compare equal to them.
"""

from __future__ import annotations

from enum import StrEnum


class AgentState(StrEnum):
    """What an agent says it is doing (every heartbeat carries it)."""

    REGISTERED = "registered"  # set by the supervisor at registration, before any heartbeat
    STARTING = "starting"  # torchrun launched, no step reported yet
    RUNNING = "running"
    STOPPING = "stopping"  # a stop or restart command is tearing the group down
    STOPPED = "stopped"
    FINISHED = "finished"  # the workers completed the run
    FAILED = "failed"  # the workers failed; the agent waits for the supervisor's decision
    SPARE = "spare"  # runs nothing: a spare, or a member standing by for a missing node


# States of an agent that is supposed to be alive and training.
LIVE_AGENT_STATES = frozenset({AgentState.REGISTERED, AgentState.STARTING, AgentState.RUNNING,
                               AgentState.STOPPING})


class NodeRole(StrEnum):
    """What a node is to its run, as the supervisor decides it (the registration reply and
    every command carry it)."""

    MEMBER = "member"  # holds a node rank of the run's world and runs its workers
    SPARE = "spare"  # runs nothing, heartbeats, and takes a lost or cordoned member's rank


class ExitOutcome(StrEnum):
    """How the local worker group (torchrun) ended."""

    COMPLETED = "completed"  # exit 0
    CRASHED = "crashed"  # a worker failed
    STOPPED = "stopped"  # by a command or a signal
    HUNG = "hung"  # the agent's watchdog killed it: no progress while the supervisor was away


class CommandKind(StrEnum):
    RESTART = "restart"
    STOP = "stop"


class CommandStatus(StrEnum):
    """A command's status: the supervisor's (pending, superseded) or the agent's last result
    for it (delivered, done, failed)."""

    PENDING = "pending"  # not acknowledged yet: re-sent with every ingest reply
    DELIVERED = "delivered"
    DONE = "done"
    FAILED = "failed"
    SUPERSEDED = "superseded"  # a newer decision replaced it before the agent picked it up


# What an agent may report about a command.
COMMAND_RESULTS = frozenset({CommandStatus.DELIVERED, CommandStatus.DONE, CommandStatus.FAILED})

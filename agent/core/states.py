"""The states and kinds that travel between the agent and the supervisor.

``StrEnum``: each member is its value, so they are written to the wire and to the store as
the plain strings they always were, and compare equal to them.
"""

from __future__ import annotations

from enum import IntEnum, StrEnum


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


# The moves an agent's state may make, from each state to the ones it may go to (staying in a
# state is no move).  The agent starts as starting; its first step (or a worker seen) makes
# it running; a stop or a restart's teardown makes it stopping, then stopped; its workers'
# exit makes it finished, failed or stopped; a restart launches it again (starting); a node
# that runs nothing stands by (spare).  Registered is the supervisor's, before any
# heartbeat: the agent never holds it.  The agent checks each move it makes against this
# (``Agent.set_state``) and logs one not listed as an error: it never stops on its own
# bookkeeping.
AGENT_TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    AgentState.REGISTERED: frozenset(),
    AgentState.STARTING: frozenset({AgentState.RUNNING, AgentState.STOPPING, AgentState.STOPPED,
                                    AgentState.FINISHED, AgentState.FAILED, AgentState.SPARE}),
    AgentState.RUNNING: frozenset({AgentState.STARTING, AgentState.STOPPING, AgentState.STOPPED,
                                   AgentState.FINISHED, AgentState.FAILED, AgentState.SPARE}),
    AgentState.STOPPING: frozenset({AgentState.STARTING, AgentState.STOPPED,
                                    AgentState.FINISHED, AgentState.FAILED, AgentState.SPARE}),
    AgentState.STOPPED: frozenset({AgentState.STARTING, AgentState.STOPPING, AgentState.FAILED,
                                   AgentState.SPARE}),
    AgentState.FINISHED: frozenset({AgentState.STOPPING, AgentState.STOPPED}),
    AgentState.FAILED: frozenset({AgentState.STARTING, AgentState.STOPPING, AgentState.STOPPED,
                                  AgentState.SPARE}),
    AgentState.SPARE: frozenset({AgentState.STARTING, AgentState.STOPPING, AgentState.STOPPED}),
}

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


class RunEnd(StrEnum):
    """How a run ended, as the stop command that ends it says (the supervisor's final run
    statuses)."""

    COMPLETED = "completed"
    FAILED = "failed"  # stopped by the policy: a restart budget spent, a bug in the script
    STOPPED = "stopped"  # stopped by an operator


class AgentExit(IntEnum):
    """``trainwarden agent``'s exit code: how the run ended, for the scheduler wrapping it
    (a Slurm step, a Kubernetes Job, a systemd unit).  0 only for a completed run."""

    COMPLETED = 0  # the run completed (this node's workers, or the supervisor said so)
    ERROR = 1  # the agent itself failed (a bug; its traceback is logged)
    USAGE = 2  # a bad flag or configuration, or another agent holds the state dir
    REFUSED = 3  # the supervisor refused the registration: the run had ended, or the node
    # was taken over; nothing was launched
    FAILED = 4  # the run failed (a restart budget spent, a bug in the training script)
    STOPPED = 5  # the run was stopped (an operator's stop)
    NOT_FOUND = 127  # the training command cannot be run (not found, not allowed)


_EXIT_OF_END = {RunEnd.COMPLETED: AgentExit.COMPLETED, RunEnd.FAILED: AgentExit.FAILED,
                RunEnd.STOPPED: AgentExit.STOPPED}


def exit_for(end: object) -> AgentExit:
    """The agent's exit code for how its run ended.  A stop that does not say (an older
    supervisor's, whose stops ended failed and stopped runs only) is no completion."""
    try:
        return _EXIT_OF_END[RunEnd(str(end))]
    except ValueError:
        return AgentExit.STOPPED

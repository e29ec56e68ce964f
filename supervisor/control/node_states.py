"""What each node of a run is now (pure): one state per node, computed here once and shown
the same by the API (``GET /api/v1/runs/{run}``'s ``agents[].state``), ``trainwarden nodes``
and the dashboard.

An agent reports its own state with every heartbeat (``AgentState``), but a node that died
reports nothing more: its last report (``running``, with its workers' CPU and memory) would
stand for ever.  So the node's state is judged from the supervisor's side, from what the
agent last said, when it said it (against the node-lost deadline), what membership made of
the node, and whether the run has ended:

``lost`` (silent past the node-lost deadline, or confirmed dead by a node-lost incident it
has not answered since) and ``replaced`` (its node rank went to another node, or a shrink
left it out) are never ``spare``; a live member that runs nothing while a node rank has no
node reads ``waiting``; every node of a run that has ended reads ``finished`` (or
``replaced``).  A node that is not live keeps its last worker and GPU readings, marked stale
with their age.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainwarden.agent.core.states import AgentState, NodeRole
from trainwarden.supervisor.enums import NodeState

_OF_REPORTED = {AgentState.REGISTERED: NodeState.STARTING,
                AgentState.STARTING: NodeState.STARTING,
                AgentState.RUNNING: NodeState.RUNNING,
                AgentState.STOPPING: NodeState.STOPPING,
                AgentState.STOPPED: NodeState.STOPPED,
                AgentState.FAILED: NodeState.FAILED,
                AgentState.FINISHED: NodeState.FINISHED,
                AgentState.SPARE: NodeState.WAITING}  # a member that reports it runs nothing


@dataclass(frozen=True)
class NodeFacts:
    role: NodeRole  # what membership makes of the node now
    reported: str  # the agent's state, as last reported (``AgentState``)
    last_seen_at: float  # when the supervisor last heard from it
    # Its node rank went to another node, or a shrink left it out (membership's record).
    replaced: bool = False
    # When an open node-lost incident named it (None: none): it is dead unless heard since.
    lost_at: float | None = None


@dataclass(frozen=True)
class RunFacts:
    now: float
    live_s: float  # the node-lost deadline: a node heard from within it is live
    ended: bool = False  # the run completed, failed or was stopped
    waiting: bool = False  # a node rank of the run has no node fit to run (``capacity``)


@dataclass(frozen=True)
class NodeView:
    state: NodeState
    seen_s: float  # seconds since the node was last heard from
    # Its worker and GPU readings are the last it sent before it went silent (or left):
    # shown with their age (``seen_s``), never as the node's present.
    stale: bool


def node_view(n: NodeFacts, run: RunFacts) -> NodeView:
    seen_s = max(0.0, run.now - n.last_seen_at)
    live = seen_s <= run.live_s and not (n.lost_at is not None
                                         and n.last_seen_at <= n.lost_at)
    gone = n.role == NodeRole.SPARE and n.replaced
    if run.ended:
        state = NodeState.REPLACED if gone and not live else NodeState.FINISHED
    elif not live:
        state = NodeState.REPLACED if gone else NodeState.LOST
    elif n.role == NodeRole.SPARE:
        state = NodeState.SPARE
    else:
        state = _member(n.reported, waiting=run.waiting)
    return NodeView(state=state, seen_s=seen_s, stale=run.ended or not live)


def _member(reported: str, *, waiting: bool) -> NodeState:
    """A live member: what its agent says, unless the run waits for a node (then it stands
    by, whatever its workers did last)."""
    try:
        own = _OF_REPORTED[AgentState(reported)]
    except (ValueError, KeyError):
        own = NodeState.STARTING
    if waiting and own not in (NodeState.FINISHED, NodeState.STARTING, NodeState.RUNNING):
        return NodeState.WAITING
    return own

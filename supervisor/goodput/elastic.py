"""A node lost with no spare free: wait for a node, or shrink?  The expected training lost
either way, for the policy to choose by and to write in its reason.

Both options start from the same point: the loss was detected and the gang restarts from
the newest complete checkpoint whatever it does, so the rollback is common to both and left
out.  What differs, in seconds of full-world training (the work the full world would have
done in that time), counted from the detection until both run on the full world again
(``horizon_s``; beyond it the two run alike):

* ``wait``: nothing trains until the node returns (``return_s``), then one restart:
  ``return_s + restart_s``;
* ``shrink``: one restart now on the ``live_nodes`` left; they keep the global batch (each
  rank does more micro-batches), so they train at ``efficiency x n / N`` of the full world's
  rate until the node has returned and the next checkpoint after it is saved
  (``to_checkpoint_s``), then a planned restart grows the run back:
  ``2 x restart_s + shrunk_s x (1 - efficiency x n / N)``, where ``shrunk_s`` is
  ``max(return_s - restart_s, 0) + to_checkpoint_s``.

Shrinking is possible only down to ``min_nodes``; a tie waits (one restart, not two).  A
return time nobody knows is taken as ``UNKNOWN_RETURN_S`` and said so in the reason.  The
step time turns the seconds into steps for the reason.  Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainwarden.agent.core.bounds import bound, bounded, check, cross_check

# The time a node from outside the pool takes to arrive, as the spares benchmark assumes
# (benchmarks/spares.py --replace-h): what an unknown return is taken as.
UNKNOWN_RETURN_S = 4 * 3600.0

Option = Literal["wait", "shrink"]


@dataclass(frozen=True)
class NodeLoss:
    """A node loss that found no spare free, as the policy sees it at the decision."""

    nodes: int = field(metadata=bound(ge=2, integer=True))  # the full world
    live_nodes: int = field(metadata=bound(ge=0, integer=True))  # left to train on
    min_nodes: int = field(metadata=bound(ge=1, integer=True))  # the run's --min-nodes
    step_s: float = field(metadata=bound(gt=0, finite=True))  # a step at the full world
    restart_s: float = field(metadata=bound(ge=0, finite=True))  # measured by the run
    # from the node's return to the checkpoint the run grows back at (about half the
    # checkpoint interval on average)
    to_checkpoint_s: float = field(metadata=bound(ge=0, finite=True))
    # until a node takes the lost one's rank; None: unknown (``UNKNOWN_RETURN_S``)
    return_s: float | None = bounded(None, ge=0, finite=True)
    # the shrunk world's throughput per node against the full world's
    efficiency: float = bounded(1.0, gt=0, le=1)

    def __post_init__(self) -> None:
        check(self)
        cross_check(self.live_nodes < self.nodes, self, "live_nodes",
                    f"< nodes ({self.nodes})", got=self.live_nodes,
                    hint="a loss leaves fewer nodes than the full world")
        cross_check(self.min_nodes <= self.nodes, self, "min_nodes",
                    f"<= nodes ({self.nodes})", got=self.min_nodes,
                    hint="the smallest world the run accepts, at most the full world")

    @property
    def returns_in_s(self) -> float:
        return UNKNOWN_RETURN_S if self.return_s is None else self.return_s


@dataclass(frozen=True)
class ShrinkChoice:
    """Expected seconds of full-world training lost per option (``shrink_s`` None: the
    world left is below ``min_nodes``), the option chosen and why, in one line."""

    wait_s: float
    shrink_s: float | None
    choice: Option
    reason: str
    horizon_s: float  # from the detection until both options run on the full world again


def lost_waiting(loss: NodeLoss) -> float:
    """Seconds of full-world training lost waiting for the node, then restarting."""
    return loss.returns_in_s + loss.restart_s


def shrunk_span_s(loss: NodeLoss) -> float:
    """Seconds trained on the smaller world: from the shrink's restart to the grow back."""
    return max(loss.returns_in_s - loss.restart_s, 0.0) + loss.to_checkpoint_s


def lost_shrinking(loss: NodeLoss) -> float | None:
    """Seconds of full-world training lost shrinking (two restarts and the slower steps);
    None where the world left is below ``min_nodes``."""
    if loss.live_nodes < loss.min_nodes:
        return None
    rate = loss.efficiency * loss.live_nodes / loss.nodes
    return 2 * loss.restart_s + shrunk_span_s(loss) * (1.0 - rate)


def choose(loss: NodeLoss) -> ShrinkChoice:
    """The option that loses less training (a tie waits), with its reason."""
    wait, shrink = lost_waiting(loss), lost_shrinking(loss)
    back = (f"a node expected in {_dur(loss.returns_in_s)}" if loss.return_s is not None
            else f"return time unknown, taken as {_dur(UNKNOWN_RETURN_S)}")
    if shrink is None:
        return ShrinkChoice(wait, None, "wait", (
            f"wait: {loss.live_nodes:,} nodes left is below min_nodes {loss.min_nodes:,}; "
            f"{back}, {_lost(wait, loss.step_s)} lost"), wait)
    choice: Option = "shrink" if shrink < wait else "wait"
    first, second = (shrink, wait) if choice == "shrink" else (wait, shrink)
    other = "waiting" if choice == "shrink" else "shrinking"
    where = f" on {loss.live_nodes:,} of {loss.nodes:,} nodes" if choice == "shrink" else ""
    horizon = max(wait, 2 * loss.restart_s + shrunk_span_s(loss))
    return ShrinkChoice(wait, shrink, choice, (
        f"{choice}{where}: {_lost(first, loss.step_s)} lost against {_lost(second, loss.step_s)}"
        f" {other} ({back}, restart {_dur(loss.restart_s)}, grow back at a checkpoint "
        f"{_dur(loss.to_checkpoint_s)} after its return)"), horizon)


def _lost(s: float, step_s: float) -> str:
    return f"{_dur(s)} (~{s / step_s:,.0f} steps)"


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"

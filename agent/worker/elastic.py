"""A global batch fixed by the run's declared world, trained on however many ranks are running.

A run declares its full world ``D`` (``TRAINWARDEN_DECLARED_WORLD_SIZE``, else ``WORLD_SIZE``).
Global batch ``g`` is ``D`` micro-batch *slots*; slot ``s`` holds the samples rank ``s`` of a
``D``-rank run trains.  On ``w <= D`` running ranks, rank ``r`` trains a contiguous block of
slots: the first ``D mod w`` ranks take ``ceil(D / w)`` slots, the others ``floor(D / w)``
(``numpy.array_split``'s rule).  With ``w == D`` that is slot ``r``: today's order.

Each slot's mean loss is multiplied by ``w / D`` before its backward.  A rank's gradient is then
``(w / D) x`` the sum of its slots' gradients, and the data-parallel mean over the ``w`` ranks
(DDP, FSDP) is ``1 / D x`` the sum over all ``D`` slots: the mean of the full-world run,
whether or not the blocks are of equal size.  Gradient synchronisation is switched off for all
but each rank's last slot, so a step makes one all-reduce (DDP) or reduce-scatter (FSDP2), as on
the full world.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from trainwarden.agent.protocol import ENV_DECLARED_WORLD_SIZE


def resolve_declared_world_size(world_size: int, declared: int | str | None = None) -> int:
    """The run's declared world: ``declared`` when given, else ``TRAINWARDEN_DECLARED_WORLD_SIZE``
    when set, else ``world_size``.  ValueError (naming the fix) for a value that is not a
    positive integer or is smaller than the ranks running."""
    source = "declared_world_size"
    if declared is None:
        raw = os.environ.get(ENV_DECLARED_WORLD_SIZE, "").strip()
        if not raw:
            return world_size
        declared, source = raw, ENV_DECLARED_WORLD_SIZE
    try:
        value = int(declared)
    except (TypeError, ValueError):
        value = 0
    if isinstance(declared, bool) or str(value) != str(declared).strip() or value <= 0:
        raise ValueError(
            f"{source}={declared!r} is not a positive integer: set it to the run's full world "
            "in ranks (declared nnodes x nproc_per_node), or leave it unset to use WORLD_SIZE")
    if value < world_size:
        raise ValueError(
            f"{source}={value} is smaller than the {world_size} ranks running: it is the run's "
            f"full world (declared nnodes x nproc_per_node), so set it to at least {world_size} "
            "(or leave it unset to use WORLD_SIZE)")
    return value


def slots_of(rank: int, world_size: int, declared: int) -> range:
    """The slots of a global batch rank ``rank`` of ``world_size`` trains (contiguous, the
    first ``declared mod world_size`` ranks one more than the others)."""
    if not 0 < world_size <= declared or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size <= declared, got rank={rank}, "
                         f"world_size={world_size}, declared={declared}")
    base, extra = divmod(declared, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


def slot_weight(world_size: int, declared: int) -> float:
    """What each slot's mean loss is multiplied by (1.0 on the full world)."""
    return 1.0 if world_size == declared else world_size / declared


@dataclass(frozen=True)
class Part:
    """One micro-batch of a global batch, as this rank trains it.

    ``data``: the collated samples of slot ``slot``; ``weight``: what its mean loss is
    multiplied by before ``backward()`` (``weighted(loss)`` does it); ``last``: the rank's last
    part of the step, whose backward synchronises the gradients."""

    data: Any
    slot: int
    weight: float
    last: bool

    def weighted(self, loss: Any) -> Any:
        """``loss x weight``; ``loss`` itself at weight 1.0, so the full world's autograd graph
        and numerics are untouched."""
        return loss if self.weight == 1.0 else loss * self.weight


@contextlib.contextmanager
def gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    """Forward and backward inside this block synchronise gradients across ranks only when
    ``enabled``: DDP (and FSDP1) through ``no_sync()``, FSDP2 through
    ``set_requires_gradient_sync``.  A module that synchronises nothing itself (or None) is
    left alone.  FSDP2's flag is set back to True on the way out, whatever happened."""
    if enabled or model is None:
        if enabled and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(True)
        yield
        return
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2 (fully_shard)
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    if hasattr(model, "no_sync"):  # DistributedDataParallel, FSDP1
        with model.no_sync():
            yield
        return
    yield

"""A deterministic, addressable data order with a resumable, skippable position.

Every *global batch* has an index ``g = 0, 1, 2, ...``.  Global batch ``g`` is made of ``D``
micro-batch slots of ``batch_size`` samples, ``D`` the run's declared world size (its full
world; the ranks running now unless ``TRAINWARDEN_DECLARED_WORLD_SIZE`` says more): slot ``s``
holds the samples at positions ``((g mod B) * D + s) * batch_size ...`` of epoch ``g div B``'s
permutation (``B`` global batches per epoch; the permutation is drawn from ``seed`` and the
epoch).  On the full world rank ``r`` trains slot ``r``; on fewer ranks each rank trains a
contiguous block of slots, one weighted micro-batch after the other
(``trainwarden.agent.worker.elastic``).  So the data a rank sees is a pure function of
(seed, g, slots): the saved position is just the next ``g``, and a resumed run, on any number of
ranks, sees exactly the samples it would have seen.  Skipping is "never yield these global
indices"; what was skipped is recorded.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from trainwarden.agent.protocol import normalize_ranges
from trainwarden.agent.worker.elastic import (
    Part,
    gradient_sync,
    resolve_declared_world_size,
    slot_weight,
    slots_of,
)

log = logging.getLogger("trainwarden")


@dataclass(frozen=True)
class Batch:
    """This rank's share of global batch ``index``: one part per slot it trains (one on the
    full world)."""

    index: int  # global batch index
    micro: tuple[Part, ...]

    @property
    def data(self) -> Any:
        """The collated samples, when this rank trains one slot (always on the full world)."""
        if len(self.micro) != 1:
            raise RuntimeError(
                f"this rank trains {len(self.micro)} micro-batches of global batch {self.index} "
                "(the run is on fewer ranks than it declares): iterate "
                "`for part in batch.parts(model):` and backward `part.weighted(loss)` for each")
        return self.micro[0].data

    def parts(self, model: Any = None) -> Iterator[Part]:
        """The parts to train one after the other, each forward and backward inside the loop
        body: gradient synchronisation of ``model`` (DDP, FSDP2) is off for all but the last.
        With one part (the full world) nothing about ``model`` is touched."""
        if len(self.micro) == 1:
            yield self.micro[0]
            return
        for part in self.micro:
            with gradient_sync(model, enabled=part.last):
                yield part


class GlobalBatchOrder:
    """Which dataset samples rank ``rank`` trains for global batch ``g``.

    ``declared_world_size`` (default: ``world_size``) is the number of slots of a global batch;
    ``slots`` are the ones this rank trains."""

    def __init__(self, dataset_len: int, *, batch_size: int, rank: int, world_size: int,
                 seed: int, shuffle: bool = True, declared_world_size: int | None = None
                 ) -> None:
        if batch_size <= 0 or world_size <= 0 or not 0 <= rank < world_size:
            raise ValueError("need batch_size > 0, world_size > 0 and 0 <= rank < world_size")
        declared = resolve_declared_world_size(
            world_size, world_size if declared_world_size is None else declared_world_size)
        per_global = batch_size * declared
        if dataset_len < per_global:
            raise ValueError(f"dataset of {dataset_len} samples is smaller than one global "
                             f"batch ({batch_size} x {declared} ranks)")
        self.dataset_len = dataset_len
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.declared_world_size = declared
        self.slots = slots_of(rank, world_size, declared)
        self.weight = slot_weight(world_size, declared)
        self.seed = seed
        self.shuffle = shuffle
        self.batches_per_epoch = dataset_len // per_global  # the remainder is dropped
        self._epoch = -1
        self._perm: list[int] = []

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                self._perm = torch.randperm(self.dataset_len, generator=g).tolist()
            else:
                self._perm = list(range(self.dataset_len))
            self._epoch = epoch
        return self._perm

    def generator_for(self, position: int) -> torch.Generator:
        """The generator a DataLoader started at ``position`` draws its base seed from.

        Without one, starting a DataLoader iterator draws that seed from the *global* torch
        RNG: the first ``next()`` after ``resume()`` restored the RNGs would shift every
        dropout mask and random augmentation of the resumed run.  Seeded from (seed, rank,
        position), the loader's workers (``num_workers > 0``) get seeds that are a function
        of where the iteration starts, never of the global RNG state."""
        return torch.Generator().manual_seed(
            (self.seed * 1_000_003 + self.rank * 7_919 + position) % (1 << 63))

    def indices(self, g: int) -> list[int]:
        """Every sample this rank trains for global batch ``g`` (its slots, in order)."""
        epoch, k = divmod(g, self.batches_per_epoch)
        start = (k * self.declared_world_size + self.slots.start) * self.batch_size
        return self._permutation(epoch)[start:start + len(self.slots) * self.batch_size]

    def slot_indices(self, g: int, slot: int) -> list[int]:
        """The samples of slot ``slot`` of global batch ``g`` (any slot, not only this rank's)."""
        if not 0 <= slot < self.declared_world_size:
            raise ValueError(f"slot {slot} is not in 0..{self.declared_world_size - 1}")
        epoch, k = divmod(g, self.batches_per_epoch)
        start = (k * self.declared_world_size + slot) * self.batch_size
        return self._permutation(epoch)[start:start + self.batch_size]


class _BatchSampler:
    """Yields one index list per slot of this rank, global batch after global batch, from
    ``start``; records the global index of each list it hands to the loader."""

    def __init__(self, order: GlobalBatchOrder, start: int,
                 skip: Sequence[tuple[int, int]], limit: int | None,
                 issued: deque[int]) -> None:
        self.order, self.start, self.skip, self.limit, self.issued = (
            order, start, list(skip), limit, issued)

    def __iter__(self) -> Iterator[list[int]]:
        g = self.start
        while self.limit is None or g < self.limit:
            nxt = _next_unskipped(g, self.skip)
            if nxt != g:
                g = nxt
                continue
            for slot in self.order.slots:
                self.issued.append(g)
                yield self.order.slot_indices(g, slot)
            g += 1


def _next_unskipped(g: int, skip: Sequence[tuple[int, int]]) -> int:
    for a, b in skip:
        if a <= g <= b:
            return b + 1
    return g


class ResumableLoader:
    """Iterates ``Batch(index, data)`` in the global order, from a restorable position.

    ``state_dict()`` holds the next global index this rank will consume (not the one the
    loader's workers have prefetched), the skip ranges, and what was skipped.  Batches are
    built by a regular ``torch.utils.data.DataLoader`` (``num_workers`` as you like); the
    DataLoader preserves order, so the consumed position is exact.  Iterating draws nothing
    from the global RNGs (torch, CUDA, NumPy, Python): the DataLoader gets a generator of its
    own (``GlobalBatchOrder.generator_for``), so the RNG states ``resume()`` restored are the
    ones the first training step after it sees, whether ``iter()`` came before or after.

    ``declared_world_size``: the run's full world, which fixes the global batch (default:
    ``TRAINWARDEN_DECLARED_WORLD_SIZE`` when set, else ``world_size``).  On fewer ranks than
    that, each ``Batch`` holds several parts (``batch.parts(model)``); the position is a global
    index, so a run resumes on any number of ranks at the same global batch.
    """

    def __init__(self, dataset: Dataset[Any], *, batch_size: int, rank: int, world_size: int,
                 seed: int, shuffle: bool = True, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 num_batches: int | None = None,
                 on_skip: Callable[[int, int], None] | None = None,
                 declared_world_size: int | None = None) -> None:
        self.order = GlobalBatchOrder(
            # (torch's Dataset declares no __len__; a map-style dataset has one)
            len(dataset), batch_size=batch_size,  # type: ignore[arg-type]
            rank=rank, world_size=world_size, seed=seed, shuffle=shuffle,
            declared_world_size=resolve_declared_world_size(world_size, declared_world_size))
        self.dataset = dataset
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.num_batches = num_batches
        self.on_skip = on_skip
        self.position = 0
        self.skip: list[tuple[int, int]] = []
        self.skipped: list[tuple[int, int]] = []

    # ---- position -----------------------------------------------------------------------
    def add_skips(self, ranges: Any) -> None:
        """Never yield the global batch indices in these inclusive ranges."""
        self.skip = normalize_ranges([list(r) for r in self.skip] +
                                     [list(r) for r in normalize_ranges(ranges)])

    def state_dict(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "skip": [list(r) for r in self.skip],
            "skipped": [list(r) for r in self.skipped],
            "batch_size": self.order.batch_size,
            "world_size": self.order.world_size,
            "declared_world_size": self.order.declared_world_size,
            "rank": self.order.rank,
            "seed": self.order.seed,
            "dataset_len": self.order.dataset_len,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at the saved position.  The state may come from another rank, or from a
        run on another number of ranks, as long as the global batch is the same: batch size,
        declared world (a state without one was saved on its full world), seed, dataset."""
        declared = state.get("declared_world_size", state.get("world_size"))
        if declared is not None and declared != self.order.declared_world_size:
            raise ValueError(
                f"checkpoint data position was saved with a declared world of {declared} ranks "
                f"but this run declares {self.order.declared_world_size}: the global batch "
                f"({declared} x batch_size samples) would change; resume with "
                f"TRAINWARDEN_DECLARED_WORLD_SIZE={declared} (any number of ranks up to it)")
        for key, mine in (("batch_size", self.order.batch_size),
                          ("seed", self.order.seed), ("dataset_len", self.order.dataset_len)):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"checkpoint data position was saved with {key}={state[key]} but this run "
                    f"has {key}={mine}: resume with the same {key} (the batch order depends "
                    "on it)")
        self.position = int(state["position"])
        self.skip = normalize_ranges(state.get("skip", []))
        self.skipped = [tuple(r) for r in state.get("skipped", [])]

    # ---- iteration ----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        issued: deque[int] = deque()
        sampler = _BatchSampler(self.order, self.position, self.skip, self.num_batches, issued)
        loader = DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers,
                            collate_fn=self.collate_fn,
                            generator=self.order.generator_for(self.position))
        slots, weight = self.order.slots, self.order.weight
        parts: list[Part] = []
        for data in loader:
            g = issued.popleft()
            slot = slots[len(parts)]
            parts.append(Part(data, slot, weight, last=slot == slots[-1]))
            if len(parts) < len(slots):
                continue
            if g > self.position:  # indices in [position, g) were skipped
                self._record_skip(self.position, g - 1)
            self.position = g + 1
            batch, parts = Batch(g, tuple(parts)), []
            yield batch

    def _record_skip(self, a: int, b: int) -> None:
        self.skipped.append((a, b))
        log.warning("trainwarden: skipped global batches %d-%d (rank %d)", a, b, self.order.rank)
        if self.on_skip is not None:
            try:
                self.on_skip(a, b)
            except Exception:
                log.exception("trainwarden: on_skip callback failed")

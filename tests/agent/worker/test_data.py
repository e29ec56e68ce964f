from __future__ import annotations

import pytest
import torch
from torch.utils.data import TensorDataset

from tests.agent.worker.rng import global_rng
from trainwarden.agent.worker import GlobalBatchOrder, ResumableLoader


def dataset(n: int = 40) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def loader(rank: int = 0, world: int = 2, workers: int = 0, **kw) -> ResumableLoader:  # type: ignore[no-untyped-def]
    return ResumableLoader(dataset(), batch_size=4, rank=rank, world_size=world, seed=5,
                           num_workers=workers, **kw)


def test_global_batches_partition_each_epoch_across_ranks() -> None:
    orders = [GlobalBatchOrder(40, batch_size=4, rank=r, world_size=2, seed=5) for r in (0, 1)]
    assert orders[0].batches_per_epoch == 5
    epoch0 = [i for g in range(5) for o in orders for i in o.indices(g)]
    assert sorted(epoch0) == list(range(40))  # every sample once per epoch, no overlap
    epoch1 = [i for g in range(5, 10) for o in orders for i in o.indices(g)]
    assert sorted(epoch1) == list(range(40)) and epoch1 != epoch0  # a new permutation
    again = GlobalBatchOrder(40, batch_size=4, rank=1, world_size=2, seed=5)
    assert [again.indices(g) for g in (7, 2)] == [orders[1].indices(g) for g in (7, 2)]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_continues_with_exactly_the_next_batch(workers: int) -> None:
    reference = loader(workers=workers)
    ref = [(b.index, b.data[0].tolist()) for _, b in zip(range(12), reference, strict=False)]
    first = loader(workers=workers)
    it = iter(first)
    for _ in range(7):
        next(it)
    state = first.state_dict()  # the loader's workers have prefetched further; must not matter
    second = loader(workers=workers)
    second.load_state_dict(state)
    rest = [(b.index, b.data[0].tolist()) for _, b in zip(range(5), second, strict=False)]
    assert rest == ref[7:]


def test_skip_ranges_are_never_yielded_and_are_recorded() -> None:
    seen: list[tuple[int, int]] = []
    ld = loader(on_skip=lambda a, b: seen.append((a, b)))
    ld.add_skips([[3, 5], [9, 9]])
    got = [b.index for _, b in zip(range(8), ld, strict=False)]
    assert got == [0, 1, 2, 6, 7, 8, 10, 11]
    assert ld.skipped == [(3, 5), (9, 9)] == seen
    assert ld.state_dict()["skip"] == [[3, 5], [9, 9]]


def test_state_from_another_configuration_is_refused() -> None:
    state = loader().state_dict()
    other = ResumableLoader(dataset(), batch_size=2, rank=0, world_size=2, seed=5)
    with pytest.raises(ValueError, match="batch_size=4 but this run has batch_size=2"):
        other.load_state_dict(state)


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(ValueError, match="smaller than one global batch"):
        ResumableLoader(dataset(6), batch_size=4, rank=0, world_size=2, seed=0)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        ResumableLoader(dataset(), batch_size=4, rank=2, world_size=2, seed=0)
    with pytest.raises(ValueError, match="from <= to"):
        loader().add_skips([[5, 3]])



@pytest.mark.parametrize("workers", [0, 2])
def test_iterating_draws_nothing_from_the_global_rngs(workers: int) -> None:
    before = global_rng()
    it = iter(loader(workers=workers))
    [next(it) for _ in range(3)]
    assert global_rng() == before
    again = loader(workers=workers)
    again.load_state_dict({"position": 2})
    assert [b.index for _, b in zip(range(2), again, strict=False)] == [2, 3]
    assert global_rng() == before

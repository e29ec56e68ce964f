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


# ---- a global batch of the declared world, on fewer ranks ------------------------------------
def _parts(ld: ResumableLoader, n: int) -> list[tuple[int, list[tuple[int, float, list[int]]]]]:
    """(global index, [(slot, weight, samples)]) of the next ``n`` batches."""
    return [(b.index, [(p.slot, p.weight, p.data[0].tolist()) for p in b.micro])
            for _, b in zip(range(n), ld, strict=False)]


def _full_world(declared: int, n: int) -> dict[int, dict[int, list[int]]]:
    """global index -> slot -> samples, as the ``declared`` ranks of the full world train them."""
    out: dict[int, dict[int, list[int]]] = {}
    for r in range(declared):
        for g, parts in _parts(loader(rank=r, world=declared), n):
            assert [(s, w) for s, w, _ in parts] == [(r, 1.0)]
            out.setdefault(g, {})[r] = parts[0][2]
    return out


def test_the_full_world_order_is_exactly_the_per_rank_order_of_before() -> None:
    """Slot r of a 2-rank run is rank r's batch by the formula the order always had."""
    for r in (0, 1):
        order = GlobalBatchOrder(40, batch_size=4, rank=r, world_size=2, seed=5)
        assert order.declared_world_size == 2 and list(order.slots) == [r]
        for g in range(12):
            epoch, k = divmod(g, order.batches_per_epoch)
            start = (k * 2 + r) * 4
            assert order.indices(g) == order._permutation(epoch)[start:start + 4]
        ld = loader(rank=r, world=2)
        assert [b.data[0].tolist() for _, b in zip(range(12), ld, strict=False)] == [
            order.indices(g) for g in range(12)]


@pytest.mark.parametrize(("declared", "world", "slots"), [
    (4, 2, [[0, 1], [2, 3]]), (3, 2, [[0, 1], [2]]), (2, 1, [[0, 1]])])
def test_a_smaller_world_trains_the_full_worlds_slots_with_weight_w_over_d(
        declared: int, world: int, slots: list[list[int]]) -> None:
    ds = TensorDataset(torch.arange(48))
    full = {}
    for r in range(declared):
        ld = ResumableLoader(ds, batch_size=4, rank=r, world_size=declared, seed=5)
        for _, b in zip(range(8), ld, strict=False):
            full.setdefault(b.index, {})[r] = b.data[0].tolist()
    for r in range(world):
        ld = ResumableLoader(ds, batch_size=4, rank=r, world_size=world, seed=5,
                             declared_world_size=declared)
        for g, parts in _parts(ld, 8):
            assert [s for s, _, _ in parts] == slots[r]
            assert all(w == world / declared for _, w, _ in parts)
            assert [d for s, _, d in parts] == [full[g][s] for s in slots[r]]
            assert ld.order.indices(g) == [i for s in slots[r] for i in full[g][s]]


def test_the_declared_world_defaults_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINWARDEN_DECLARED_WORLD_SIZE", "4")
    ld = loader(rank=1, world=2)
    assert ld.order.declared_world_size == 4 and list(ld.order.slots) == [2, 3]
    assert loader(world=2, declared_world_size=2).order.declared_world_size == 2
    monkeypatch.setenv("TRAINWARDEN_DECLARED_WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="smaller than the 2 ranks running"):
        loader(world=2)


@pytest.mark.parametrize(("saved_world", "world"), [(2, 1), (1, 2)])
def test_a_position_moves_between_worlds_of_the_same_declared_world(saved_world: int,
                                                                     world: int) -> None:
    """Shrinking and growing: every rank continues at the same next global batch, whichever
    rank's state it loads (a rank of the grown world that had none loads rank 0's)."""
    full = _full_world(2, 9)
    first = loader(rank=0, world=saved_world, declared_world_size=2)
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    assert state["declared_world_size"] == 2 and state["world_size"] == saved_world
    for r in range(world):
        ld = loader(rank=r, world=world, declared_world_size=2)
        ld.load_state_dict(state)
        for g, parts in _parts(ld, 4):
            assert [d for _, _, d in parts] == [full[g][s] for s in ld.order.slots]
        assert ld.position == 9


def test_a_position_of_another_declared_world_is_refused_naming_the_fix() -> None:
    state = loader(world=2).state_dict()
    with pytest.raises(ValueError, match=r"declared world of 2 ranks but this run declares 4: "
                                         r"the global batch .* would change; resume with "
                                         r"TRAINWARDEN_DECLARED_WORLD_SIZE=2"):
        loader(world=2, declared_world_size=4).load_state_dict(state)


def test_a_position_saved_before_declared_worlds_counts_its_world_as_declared() -> None:
    state = loader(world=2).state_dict()
    del state["declared_world_size"]
    loader(world=1, declared_world_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="declared world of 2 ranks but this run declares 1"):
        loader(world=1).load_state_dict(state)

"""The global batch of the declared world on fewer ranks: which slots a rank trains, the
weights that keep the mean, gradient sync on the last part only, and the declared world's
checks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from trainwarden.agent.protocol import ENV_DECLARED_WORLD_SIZE
from trainwarden.agent.worker import Part, gradient_sync, resolve_declared_world_size
from trainwarden.agent.worker.data import Batch
from trainwarden.agent.worker.elastic import slot_weight, slots_of


def test_the_variable_is_named_in_the_protocol() -> None:
    assert ENV_DECLARED_WORLD_SIZE == "TRAINWARDEN_DECLARED_WORLD_SIZE"


@pytest.mark.parametrize(("declared", "world", "expected"), [
    (4, 4, [[0], [1], [2], [3]]),  # the full world: slot r, today's order
    (4, 2, [[0, 1], [2, 3]]),
    (3, 2, [[0, 1], [2]]),  # uneven: the first D mod w ranks take one more
    (5, 3, [[0, 1], [2, 3], [4]]),
    (2, 1, [[0, 1]]),
])
def test_each_slot_goes_to_exactly_one_rank_in_contiguous_blocks(
        declared: int, world: int, expected: list[list[int]]) -> None:
    got = [list(slots_of(r, world, declared)) for r in range(world)]
    assert got == expected
    assert sorted(s for block in got for s in block) == list(range(declared))


def test_weights_make_the_mean_over_ranks_the_mean_over_slots() -> None:
    assert slot_weight(2, 2) == 1.0
    assert slot_weight(1, 2) == 0.5
    assert slot_weight(2, 4) == 0.5
    for declared, world in ((3, 2), (5, 3), (4, 2), (7, 4)):
        w = slot_weight(world, declared)
        per_rank = [w * len(slots_of(r, world, declared)) for r in range(world)]
        # DDP averages the ranks' gradients: each slot ends up counted 1 / declared.
        assert sum(per_rank) / world == pytest.approx(1.0)


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _slot_grads(model: torch.nn.Module, xs: list[torch.Tensor], ys: list[torch.Tensor],
                slots: range, weight: float) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    for s in slots:
        loss = torch.nn.functional.mse_loss(model(xs[s]), ys[s])
        Part(None, s, weight, s == slots[-1]).weighted(loss).backward()
    return _grads(model)


@pytest.mark.parametrize(("declared", "world"), [(2, 1), (4, 2), (3, 2), (3, 1)])
def test_accumulated_weighted_parts_give_the_full_worlds_gradient(declared: int,
                                                                  world: int) -> None:
    """The gradient data-parallel training applies (the mean over ranks of each rank's
    gradient) is the full world's, one slot per rank; exactly so where the weight is a power
    of two and two ranks' gradients are combined (DDP divides each by the world size, then
    sums)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.GELU(), torch.nn.Linear(16, 3))
    xs = [torch.randn(5, 6) for _ in range(declared)]
    ys = [torch.randn(5, 3) for _ in range(declared)]
    full = [_slot_grads(model, xs, ys, range(s, s + 1), 1.0) for s in range(declared)]
    reference = [sum(g[i] / declared for g in full) for i in range(len(full[0]))]
    weight = slot_weight(world, declared)
    ranks = [_slot_grads(model, xs, ys, slots_of(r, world, declared), weight)
             for r in range(world)]
    got = [sum(g[i] / world for g in ranks) for i in range(len(ranks[0]))]
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if (declared, world) == (2, 1):
        assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))


def test_weight_one_leaves_the_loss_itself() -> None:
    loss = torch.tensor(2.5, requires_grad=True)
    assert Part(None, 0, 1.0, True).weighted(loss) is loss
    assert Part(None, 0, 0.5, True).weighted(loss).detach().item() == 1.25


@pytest.mark.parametrize("value", ["0", "-2", "two", "2.0", "1e3", " "])
def test_a_declared_world_that_is_not_a_positive_integer_is_refused(
        monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, value)
    if not value.strip():  # set but empty: as if unset
        assert resolve_declared_world_size(2) == 2
        return
    with pytest.raises(ValueError, match=r"TRAINWARDEN_DECLARED_WORLD_SIZE=.* is not a positive "
                                         r"integer: set it to the run's full world"):
        resolve_declared_world_size(2)


def test_a_declared_world_below_the_running_world_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    with pytest.raises(ValueError, match=r"=2 is smaller than the 4 ranks running: .* set it "
                                         r"to at least 4"):
        resolve_declared_world_size(4)
    with pytest.raises(ValueError, match="declared_world_size=1 is smaller than the 2 ranks"):
        resolve_declared_world_size(2, 1)
    with pytest.raises(ValueError, match="declared_world_size=True is not a positive integer"):
        resolve_declared_world_size(1, True)


def test_the_declared_world_comes_from_the_argument_then_the_environment_then_the_world(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_DECLARED_WORLD_SIZE, raising=False)
    assert resolve_declared_world_size(3) == 3
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "8")
    assert resolve_declared_world_size(3) == 8
    assert resolve_declared_world_size(3, 4) == 4


class _FSDP2Like(torch.nn.Module):
    """Records ``set_requires_gradient_sync`` as FSDP2's ``fully_shard`` module takes it."""

    def __init__(self) -> None:
        super().__init__()
        self.sync = True
        self.calls: list[bool] = []

    def set_requires_gradient_sync(self, requires: bool) -> None:
        self.sync = requires
        self.calls.append(requires)


def _batch(n: int) -> Batch:
    w = 1.0 if n == 1 else 1 / n
    return Batch(7, tuple(Part(f"d{i}", i, w, i == n - 1) for i in range(n)))


def test_parts_switch_fsdp2_gradient_sync_off_for_all_but_the_last() -> None:
    model = _FSDP2Like()
    seen = [(p.data, model.sync) for p in _batch(3).parts(model)]
    assert seen == [("d0", False), ("d1", False), ("d2", True)]
    assert model.sync is True


def test_a_part_loop_left_early_turns_fsdp2_gradient_sync_back_on() -> None:
    model = _FSDP2Like()
    for _part in _batch(3).parts(model):
        break
    assert model.sync is True


def test_one_part_touches_nothing_and_has_the_old_data() -> None:
    model = _FSDP2Like()
    batch = _batch(1)
    assert [p.data for p in batch.parts(model)] == ["d0"] and model.calls == []
    assert batch.data == "d0"


def test_the_data_of_several_parts_names_the_loop_to_write() -> None:
    with pytest.raises(RuntimeError, match=r"trains 2 micro-batches of global batch 7 .*"
                                           r"for part in batch.parts\(model\)"):
        _ = _batch(2).data


@pytest.mark.usefixtures("world1")
def test_parts_use_ddps_no_sync_for_all_but_the_last() -> None:
    model = DDP(torch.nn.Linear(2, 2))
    seen = [model.require_backward_grad_sync for _ in _batch(3).parts(model)]
    assert seen == [False, False, True]
    assert model.require_backward_grad_sync is True


def test_a_module_that_syncs_nothing_itself_is_left_alone() -> None:
    model: Any = torch.nn.Linear(2, 2)
    with gradient_sync(model, enabled=False):
        pass
    assert [p.slot for p in _batch(2).parts(model)] == [0, 1]
    assert [p.slot for p in _batch(2).parts(None)] == [0, 1]

"""The Lightning callback on fewer ranks than the run declares (one process, CPU): a step
trains the declared world's global batch, and a resume across world sizes (accumulations)
continues at the next global batch, none trained twice or skipped.

A run "on two ranks" here is rank 0 of a fake two-rank process group (collectives are no-ops):
its loop progress, accumulation and data are what rank 0 of a real two-rank run has, its
weights are not (no gradient all-reduce).  ``tests/e2e/test_lightning_elastic.py`` runs the
real thing under torchrun."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.waiting import wait_for
from tests.wire import Receiver
from trainwarden.agent.protocol import ENV_AGENT_SOCKET, ENV_DECLARED_WORLD_SIZE, ENV_RESUME_PLAN
from trainwarden.agent.worker.data import GlobalBatchOrder
from trainwarden.agent.worker.report import Reporter, set_reporter

pytest.importorskip("lightning")

SEED = 3
N = 96  # samples: 4 global batches of 24, 6 of 16, 12 of 8


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Receiver]:
    r = Receiver(tmp_path / "agent.sock")
    monkeypatch.setenv(ENV_AGENT_SOCKET, r.path)
    monkeypatch.delenv(ENV_RESUME_PLAN, raising=False)
    monkeypatch.delenv(ENV_DECLARED_WORLD_SIZE, raising=False)
    set_reporter(Reporter(r.path))
    yield r
    set_reporter(None)
    r.close()


class FakeWorld:
    """Rank 0 of ``world`` ranks: a fake process group (every collective a no-op)."""

    def __init__(self, world: int) -> None:
        self.world = world

    def __enter__(self) -> FakeWorld:
        if self.world > 1:
            from torch.testing._internal.distributed.fake_pg import FakeStore

            dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=self.world)
        return self

    def __exit__(self, *exc: Any) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def data() -> torch.utils.data.Dataset[Any]:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(N, 4, generator=g),
                                          torch.randn(N, 1, generator=g), torch.arange(N))


def global_batch(g: int, *, batch_size: int, accumulate: int, declared: int) -> list[int]:
    """The samples of global batch ``g`` of the declared world, every rank's."""
    order = GlobalBatchOrder(N, batch_size=batch_size * accumulate, rank=0, world_size=1,
                             seed=SEED, declared_world_size=declared)
    return sorted(i for s in range(declared) for i in order.slot_indices(g, s))


def fit(ckdir: Path, steps: int, *, batch_size: int = 4, accumulate: int = 1,
        world: int = 1, every: int = 2, val_check_interval: int | None = None,
        manual: bool = False) -> SimpleNamespace:
    """One start of a Lightning run (rank 0 of ``world``) to ``steps`` optimiser steps,
    resuming from ``ckdir``.  Returns the callback, the module, the trainer and, per step,
    the samples (dataset indices) it trained."""
    import lightning.pytorch as pl

    from trainwarden.agent.integrations.lightning import TrainwardenCallback

    trained: dict[int, list[int]] = {}
    validated: list[int] = []  # the optimiser steps done at each validation

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)
            self.automatic_optimization = not manual

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, ids = batch
            trained.setdefault(self.trainer.global_step, []).extend(ids.tolist())
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            if manual:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                validated.append(self.trainer.global_step)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.05)

    val: dict[str, Any] = {}
    if val_check_interval is not None:
        val = {"val_dataloaders": torch.utils.data.DataLoader(data(), batch_size=32)}
    with FakeWorld(world):
        torch.manual_seed(0)
        module = Module()
        tw = TrainwardenCallback(ckdir, keep=10, seed=SEED, retention_grace_s=0.0)
        trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             accumulate_grad_batches=accumulate, num_sanity_val_steps=0,
                             val_check_interval=val_check_interval,
                             limit_val_batches=1 if val_check_interval else None,
                             callbacks=[tw, tw.model_checkpoint(every_n_train_steps=every)])
        loader = tw.dataloader(data(), batch_size=batch_size)
        trainer.fit(module, train_dataloaders=loader, ckpt_path=tw.ckpt_path(), **val)
    return SimpleNamespace(tw=tw, module=module, trainer=trainer, trained=trained,
                           validated=validated)


def reports(agent: Receiver, n: int) -> list[tuple[int, int, int]]:
    wait_for(lambda: len(agent.of("step")) == n, what=f"{n} step reports")
    return [(m["step"], m["batch_index"], m["samples"]) for m in agent.of("step")]


# ---- the data: each global batch's micro-batches spread over the ranks --------------------
@pytest.mark.parametrize(("declared", "world", "accumulate"),
                         [(2, 1, 1), (2, 1, 2), (4, 2, 1), (4, 2, 3), (3, 2, 2), (4, 3, 3)])
def test_the_ranks_running_share_the_declared_worlds_micro_batches(
        declared: int, world: int, accumulate: int) -> None:
    """Every rank of ``world`` gets ``accumulate x declared / world`` micro-batches of
    ``batch_size`` per step; together, in rank order, they are the full world's micro-batches
    of that step (rank after rank, each its slot in ``accumulate`` micro-batches)."""
    from trainwarden.agent.integrations.lightning import TrainwardenLoader

    def micro_batches(rank: int, ranks: int, per_rank: int) -> list[list[int]]:
        session = SimpleNamespace(rank=rank, world_size=ranks, declared_world_size=declared,
                                  seed=SEED, batch_index=lambda step: step + 1,
                                  resumed=SimpleNamespace(start_step=5))
        loader = TrainwardenLoader(torch.utils.data.TensorDataset(torch.arange(N)),
                                   session,  # type: ignore[arg-type]
                                   batch_size=2, transform=lambda g, b: (g, b[0].tolist()))
        loader.full_micro, loader.micro = accumulate, per_rank
        it = iter(loader)
        got = [next(it) for _ in range(2 * per_rank)]  # two steps
        assert [g for g, _ in got] == [6] * per_rank + [7] * per_rank
        return [ids for _, ids in got]

    share = accumulate * declared // world
    full = [micro_batches(r, declared, accumulate) for r in range(declared)]
    running = [micro_batches(r, world, share) for r in range(world)]
    for step in (0, 1):
        want = [m for r in full for m in r[step * accumulate:(step + 1) * accumulate]]
        got = [m for r in running for m in r[step * share:(step + 1) * share]]
        assert got == want
        assert all(len(m) == 2 for m in got)
        assert sorted(i for m in got for i in m) == global_batch(
            6 + step, batch_size=2, accumulate=accumulate, declared=declared)


def test_manual_optimization_on_fewer_ranks_is_refused(
        tmp_path: Path, agent: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    fit(tmp_path / "whole", 2, manual=True)  # the full world: one micro-batch a step
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    with pytest.raises(ValueError, match="on 1 of the 2 ranks declared a step takes 2 "
                                         "micro-batches, which Lightning accumulates for "
                                         "automatic optimization only: restart on the full "
                                         "world"):
        fit(tmp_path / "ck", 2, manual=True)


def test_a_world_that_cannot_share_the_micro_batches_evenly_is_refused(
        tmp_path: Path, agent: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "3")
    with pytest.raises(ValueError, match="Lightning callback: a global batch of 3 ranks x 1 "
                                         "accumulation steps = 3 micro-batches cannot be shared "
                                         "evenly by the 2 ranks running: restart on a number "
                                         "of ranks that divides 3, or on the full world"):
        fit(tmp_path / "ck", 2, world=2)


# ---- one rank of two ------------------------------------------------------------------------
def test_one_rank_of_two_accumulates_and_trains_the_declared_global_batch(
        tmp_path: Path, agent: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank of a run declaring two: ``accumulate_grad_batches`` doubles, each step trains
    both ranks' samples of its global batch, and the weights end as a one-rank run's with one
    micro-batch of 8 (the same samples per step: equal up to summation order)."""
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    shrunk = fit(tmp_path / "shrunk", 8)
    assert shrunk.trainer.accumulate_grad_batches == 2
    assert reports(agent, 8) == [(s, s, 8) for s in range(8)]
    assert shrunk.trained == {s: shrunk.trained[s] for s in range(8)}
    for s, ids in shrunk.trained.items():
        assert sorted(ids) == global_batch(s, batch_size=4, accumulate=1, declared=2), s

    monkeypatch.delenv(ENV_DECLARED_WORLD_SIZE)
    whole = fit(tmp_path / "whole", 8, batch_size=8)
    assert whole.trained == shrunk.trained  # a one-rank global batch of 8: the same samples
    for a, b in zip(shrunk.module.state_dict().values(), whole.module.state_dict().values(),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---- resuming across world sizes ------------------------------------------------------------
def progress(trainer: Any) -> int:
    return int(trainer.fit_loop.epoch_loop.batch_progress.total.ready)


@pytest.mark.parametrize(("first", "then"), [(2, 1), (1, 2)], ids=["shrink", "grow"])
def test_a_resume_on_another_world_trains_the_next_global_batch(
        tmp_path: Path, agent: Receiver, monkeypatch: pytest.MonkeyPatch, first: int,
        then: int) -> None:
    """Saved at step 3 by rank 0 of ``first`` ranks of a run declaring two, resumed on
    ``then``: Lightning's restored loop progress counted 3 steps of the old accumulation (3 or
    6 micro-batches); the first resumed step trains global batch 3 with the new accumulation's
    full count of micro-batches, and every step after it the next global batch."""
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    ck = tmp_path / "ck"
    a = fit(ck, 3, world=first, every=3)
    k_first, k_then = 2 // first, 2 // then
    assert progress(a.trainer) == 3 * k_first
    b = fit(ck, 8, world=then, every=3)
    assert b.tw.session.resumed.start_step == 3
    assert b.trainer.global_step == 8
    assert progress(b.trainer) == 8 * k_then
    rows = reports(agent, 8)
    assert rows == [(s, s, 4 * k_first) for s in range(3)] + [
        (s, s, 4 * k_then) for s in range(3, 8)]
    assert sorted(a.trained) == [0, 1, 2] and sorted(b.trained) == [3, 4, 5, 6, 7]
    for s, ids in (a.trained | b.trained).items():  # rank 0's share of global batch s
        order = GlobalBatchOrder(N, batch_size=4, rank=0, world_size=first if s < 3 else then,
                                 seed=SEED, declared_world_size=2)
        assert ids == order.indices(s), s


def test_a_resume_with_another_accumulation_ends_as_the_uninterrupted_run(
        tmp_path: Path, agent: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same global batches (one rank declaring two, 8 samples a step) split 2 x 4 before a
    save at step 3 and 4 x 2 after it: the resume trains global batches 3..7 once each, with 4
    micro-batches a step from the first one on, and the weights end as the uninterrupted
    run's (2 x 4 throughout), up to summation order."""
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    clean = fit(tmp_path / "clean", 8)
    ck = tmp_path / "ck"
    a = fit(ck, 3, every=3)
    b = fit(ck, 8, batch_size=2, accumulate=2, every=3)
    assert b.trainer.accumulate_grad_batches == 4
    assert progress(b.trainer) == 8 * 4
    assert a.trained | b.trained == clean.trained
    rows = reports(agent, 16)[8:]
    assert rows == [(s, s, 8) for s in range(8)]
    for x, y in zip(clean.module.state_dict().values(), b.module.state_dict().values(),
                    strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_the_full_worlds_progress_is_left_as_saved() -> None:
    from trainwarden.agent.integrations.lightning import restore_progress

    def ckpt(step: int, ready: int) -> dict[str, Any]:
        counts = {"ready": ready, "started": ready, "processed": ready, "completed": ready - 1}
        return {"global_step": step, "loops": {"fit_loop": {"epoch_loop.batch_progress": {
            "total": dict(counts), "current": dict(counts), "is_last_batch": False}}}}

    same = ckpt(6, 12)
    assert not restore_progress(same, 2)
    assert same == ckpt(6, 12)
    other = ckpt(6, 12)  # two micro-batches a step, resumed with three
    assert restore_progress(other, 3)
    assert other == ckpt(6, 18)
    inside = ckpt(6, 13)  # saved (on time) after the first micro-batch of step 7
    assert restore_progress(inside, 2)
    assert inside == ckpt(6, 12)
    assert not restore_progress({"global_step": 0}, 2)



def test_validation_comes_after_the_same_steps_on_fewer_ranks(
        tmp_path: Path, agent: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """``val_check_interval`` counts training micro-batches: on one rank of two it is doubled
    with the accumulation, so validation follows the same optimiser steps (and a save and
    resume in between keeps them)."""
    whole = fit(tmp_path / "whole", 8, accumulate=2, val_check_interval=6, every=3)
    assert whole.validated == [3, 6]
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    ck = tmp_path / "ck"
    a = fit(ck, 4, world=2, accumulate=2, val_check_interval=6, every=4)
    b = fit(ck, 8, accumulate=2, val_check_interval=6, every=4)
    assert b.trainer.val_check_interval == 12
    assert a.validated + b.validated == [3, 6]
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "3")
    with pytest.raises(ValueError, match=r"val_check_interval=3 training batches \(3/2 "
                                         r"optimiser steps\) is no whole number of batches at "
                                         r"3 per step on 2 of the 3 ranks declared: give "
                                         r"val_check_interval as a multiple of "
                                         r"accumulate_grad_batches \(2\)"):
        fit(tmp_path / "odd", 2, world=2, accumulate=2, val_check_interval=3)

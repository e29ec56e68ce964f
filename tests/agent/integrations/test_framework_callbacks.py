"""The callbacks inside a real Hugging Face Trainer and a real Lightning Trainer (one process,
CPU): reports every step, checkpoints reported once complete, and retention (the Trainer's
save_total_limit, Lightning's top-k) that never deletes a checkpoint the supervisor pinned."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.waiting import wait_for
from tests.wire import Receiver
from trainwarden.agent.integrations._core import accumulation_for
from trainwarden.agent.protocol import (
    ENV_AGENT_SOCKET,
    ENV_DECLARED_WORLD_SIZE,
    ENV_RESUME_PLAN,
    PIN_FILE,
)
from trainwarden.agent.worker import read_meta
from trainwarden.agent.worker.report import Reporter, set_reporter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(8) * (i + 1)) % 16
        return {"input_ids": ids, "labels": ids}


def hf_trainer(tmp_path: Path, tw: Any, *callbacks: Any, save_total_limit: int = 1,
               **overrides: Any) -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1,
                                       n_head=1, bos_token_id=0, eos_token_id=0))
    kw: dict[str, Any] = dict(
        output_dir=str(tmp_path / "ck"), max_steps=8, per_device_train_batch_size=4,
        save_strategy="steps", save_steps=2, save_total_limit=save_total_limit,
        train_sampling_strategy="sequential", ignore_data_skip=True, report_to="none",
        disable_tqdm=True, use_cpu=True, logging_steps=100)
    kw.update(overrides)
    args = TrainingArguments(**kw)
    data = tw.dataset(Tokens()) if tw is not None else Tokens()
    return Trainer(model=model, args=args, train_dataset=data,
                   callbacks=[c for c in (tw, *callbacks) if c is not None])


def pin_at(step: int, hook: str) -> Any:
    """A callback standing in for the agent: pins the checkpoint of ``step`` once saved."""
    from transformers import TrainerCallback

    class Pin(TrainerCallback):
        pass

    def on_save(self: Any, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.global_step == step:
            (Path(args.output_dir) / f"checkpoint-{step}" / PIN_FILE).write_text("protect\n")

    setattr(Pin, hook, on_save)
    return Pin()


def test_the_trainers_own_rotation_deletes_a_pinned_checkpoint(tmp_path: Path) -> None:
    """Why the callback takes save_total_limit over: without it the pin means nothing."""
    trainer = hf_trainer(tmp_path, None, pin_at(2, "on_save"))
    trainer.train()
    assert not (tmp_path / "ck" / "checkpoint-2").exists()


def test_hf_reports_every_step_and_keeps_the_pinned_checkpoint(
        tmp_path: Path, agent: Receiver) -> None:
    from trainwarden.agent.integrations.hf import TrainwardenCallback

    tw = TrainwardenCallback(retention_grace_s=0.0)
    trainer = hf_trainer(tmp_path, tw, pin_at(2, "on_save"))
    trainer.train(resume_from_checkpoint=tw.resume_from_checkpoint())
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["checkpoint-2", "checkpoint-8"]
    assert trainer.args.save_total_limit is None  # taken over: keep 1, pins, the grace
    wait_for(lambda: len(agent.of("step")) == 8 and len(agent.of("checkpoint")) == 4,
             what="8 step and 4 checkpoint reports")
    steps = agent.of("step")
    assert [m["step"] for m in steps] == list(range(8))
    assert [m["batch_index"] for m in steps] == list(range(8))
    assert all(m["loss"] > 0 and m["lr"] > 0 and m["grad_norm"] > 0 for m in steps)
    assert all(m["samples"] == 4 and m["tokens"] == 32 for m in steps)
    assert all(m["compute_s"] is not None and m["data_s"] is not None for m in steps)
    saved = agent.of("checkpoint")
    assert [m["step"] for m in saved] == [2, 4, 6, 8]
    assert saved[-1]["path"] == str((ck / "checkpoint-8").resolve())


def test_hf_refuses_settings_that_would_break_the_order(tmp_path: Path) -> None:
    from trainwarden.agent.integrations.hf import TrainwardenCallback

    with pytest.raises(ValueError, match='train_sampling_strategy="sequential"'):
        hf_trainer(tmp_path, TrainwardenCallback(), train_sampling_strategy="random")
    with pytest.raises(ValueError, match="ignore_data_skip=True"):
        hf_trainer(tmp_path, TrainwardenCallback(), ignore_data_skip=False)
    with pytest.raises(TypeError, match="map-style dataset"):
        TrainwardenCallback().dataset(Stream())


def no_dropout(trainer: Any) -> Any:
    """Dropout masks drawn for one micro-batch of 8 are not those of two of 4."""
    for m in trainer.model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return trainer


def test_hf_on_fewer_ranks_than_declared_accumulates_the_declared_global_batch(
        tmp_path: Path, agent: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank of a run declaring two: gradient accumulation doubles, each step trains the
    two-rank run's 8 samples, and the weights end as a one-rank run's with a batch of 8 (the
    same samples per step, as one micro-batch: equal up to summation order)."""
    from trainwarden.agent.integrations.hf import TrainwardenCallback

    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    tw = TrainwardenCallback(retention_grace_s=0.0)
    shrunk = no_dropout(hf_trainer(tmp_path / "shrunk", tw))
    assert shrunk.args.gradient_accumulation_steps == 2
    shrunk.train(resume_from_checkpoint=tw.resume_from_checkpoint())
    wait_for(lambda: len(agent.of("step")) == 8, what="8 step reports")
    steps = agent.of("step")
    assert [(m["step"], m["batch_index"], m["samples"]) for m in steps] == [
        (s, s, 8) for s in range(8)]
    assert read_meta(tmp_path / "shrunk" / "ck" / "checkpoint-8")["declared_world_size"] == 2

    monkeypatch.delenv(ENV_DECLARED_WORLD_SIZE)
    tw2 = TrainwardenCallback(retention_grace_s=0.0)
    whole = no_dropout(hf_trainer(tmp_path / "whole", tw2, per_device_train_batch_size=8))
    whole.train(resume_from_checkpoint=tw2.resume_from_checkpoint())
    for a, b in zip(shrunk.model.state_dict().values(), whole.model.state_dict().values(),
                    strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_accumulation_keeps_the_global_batch_or_refuses_an_uneven_share() -> None:
    assert accumulation_for(1, world_size=1, declared=2) == 2
    assert accumulation_for(2, world_size=2, declared=4) == 4
    assert accumulation_for(2, world_size=2, declared=3) == 3
    assert accumulation_for(3, world_size=4, declared=4) == 3
    with pytest.raises(ValueError, match="3 micro-batches cannot be shared evenly by the 2 "
                                         "ranks running"):
        accumulation_for(1, world_size=2, declared=3)


def test_hf_refuses_a_checkpoint_of_another_declared_world(
        tmp_path: Path, agent: Receiver, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainwarden.agent.integrations.hf import TrainwardenCallback

    tw = TrainwardenCallback(retention_grace_s=0.0)
    trainer = hf_trainer(tmp_path, tw, max_steps=2)
    trainer.train(resume_from_checkpoint=tw.resume_from_checkpoint())
    monkeypatch.setenv(ENV_DECLARED_WORLD_SIZE, "2")
    tw2 = TrainwardenCallback()
    hf_trainer(tmp_path, tw2, max_steps=2)
    with pytest.raises(ValueError, match="declaring 1 ranks, this run declares 2: resuming "
                                         "would change the global batch"):
        tw2.resume_from_checkpoint()


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self) -> Iterator[int]:
        yield from range(4)


def test_hf_training_without_the_resume_call_is_refused(tmp_path: Path) -> None:
    from trainwarden.agent.integrations.hf import TrainwardenCallback

    trainer = hf_trainer(tmp_path, TrainwardenCallback())
    with pytest.raises(RuntimeError, match=r"resume_from_checkpoint=tw\.resume_from_checkpoint"):
        trainer.train()


def lightning_run(tmp_path: Path, grace: float, extra: list[Any] | None = None) -> Any:
    import lightning.pytorch as pl

    from trainwarden.agent.integrations.lightning import TrainwardenCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class Pin(pl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            p = tmp_path / "ck" / "step_2"
            if p.is_dir():
                (p / PIN_FILE).write_text("protect\n")

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g),
                                          torch.randn(64, 1, generator=g))
    tw = TrainwardenCallback(tmp_path / "ck", keep=1, retention_grace_s=grace)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[tw, tw.model_checkpoint(every_n_train_steps=2), Pin(),
                                    *(extra or [])])
    trainer.fit(Module(), train_dataloaders=tw.dataloader(data, batch_size=4),
                ckpt_path=tw.ckpt_path())
    return tw


def test_lightning_top_k_never_deletes_the_pinned_checkpoint(tmp_path: Path,
                                                             agent: Receiver) -> None:
    lightning_run(tmp_path, grace=0.0)
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.iterdir()) == ["step_2", "step_8"]
    wait_for(lambda: len(agent.of("step")) == 8 and len(agent.of("checkpoint")) == 4,
             what="8 step and 4 checkpoint reports")
    steps = agent.of("step")
    assert [m["batch_index"] for m in steps] == list(range(8))
    assert all(m["loss"] > 0 and m["lr"] == pytest.approx(0.1) for m in steps)
    assert [m["step"] for m in agent.of("checkpoint")] == [2, 4, 6, 8]


def test_lightning_refuses_a_plain_model_checkpoint(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    with pytest.raises(ValueError, match="plain ModelCheckpoint"):
        lightning_run(tmp_path, grace=0.0, extra=[ModelCheckpoint(dirpath=str(tmp_path / "x"))])


def lightning_fit(ckdir: Path, steps: int, *, ckpt_path_first: bool) -> tuple[Any, Any]:
    """A Lightning run of ``steps`` optimiser steps that resumes from ``ckdir``; the loader and
    the resume call made in either order.  Returns the callback and the module."""
    import lightning.pytorch as pl

    from trainwarden.agent.integrations.lightning import TrainwardenCallback

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g),
                                          torch.randn(64, 1, generator=g))
    torch.manual_seed(0)
    module = Module()
    tw = TrainwardenCallback(ckdir, keep=10, seed=3)
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[tw, tw.model_checkpoint(every_n_train_steps=2)])
    if ckpt_path_first:
        ckpt_path = tw.ckpt_path()
        loader = tw.dataloader(data, batch_size=4)
    else:
        loader = tw.dataloader(data, batch_size=4)
        ckpt_path = tw.ckpt_path()
    trainer.fit(module, train_dataloaders=loader, ckpt_path=ckpt_path)
    return tw, module


@pytest.mark.parametrize("ckpt_path_first", [False, True], ids=["loader-first", "ckpt-first"])
def test_lightning_resume_does_not_depend_on_the_order_of_the_two_calls(
        tmp_path: Path, agent: Receiver, ckpt_path_first: bool) -> None:
    """``tw.ckpt_path()`` before ``tw.dataloader(...)`` resumes as the docs' order does: the
    loader made after the resume call starts at the resumed step's batch, and the weights end
    bit-identical to an uninterrupted run's."""
    _, clean = lightning_fit(tmp_path / "clean", 8, ckpt_path_first=False)
    lightning_fit(tmp_path / "ck", 4, ckpt_path_first=ckpt_path_first)
    tw, resumed = lightning_fit(tmp_path / "ck", 8, ckpt_path_first=ckpt_path_first)
    assert tw.session.resumed.start_step == 4
    for a, b in zip(clean.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    wait_for(lambda: len(agent.of("step")) == 16, what="16 step reports")
    resumed_steps = agent.of("step")[12:]
    assert [(m["step"], m["batch_index"]) for m in resumed_steps] == [(s, s) for s in range(4, 8)]


@pytest.mark.parametrize("under_agent", [True, False], ids=["under-agent", "plain"])
def test_lightning_sigterm_during_training_is_the_handler_from_before_fit_under_the_agent(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, under_agent: bool) -> None:
    """Under the agent, SIGTERM keeps the handler it had before ``fit`` (the user's, or the
    default that ends the process) while training; a plain run keeps Lightning's.  Either way
    the handler from before ``fit`` is back after it."""
    import lightning.pytorch as pl

    if under_agent:
        monkeypatch.setenv(ENV_AGENT_SOCKET, str(tmp_path / "absent.sock"))
    else:
        monkeypatch.delenv(ENV_AGENT_SOCKET, raising=False)
    monkeypatch.delenv(ENV_RESUME_PLAN, raising=False)
    seen: list[Any] = []

    class Watch(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            seen.append(signal.getsignal(signal.SIGTERM))

    def users_handler(signum: int, frame: Any) -> None:
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, users_handler)
    try:
        lightning_run(tmp_path, grace=0.0, extra=[Watch()])
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert len(seen) == 8
    if under_agent:
        assert all(h is users_handler for h in seen), seen
    else:  # Lightning's own handler, which chains to the user's
        assert all(type(h).__name__ == "_HandlersCompose" for h in seen), seen
    assert after is users_handler

"""trainwarden for PyTorch Lightning (``pip install trainwarden[lightning]``).

    info = init_distributed(timeout=60)             # before the Trainer: Lightning uses it
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))   # torchrun's --nproc_per_node
    tw = TrainwardenCallback(ckpt_dir)
    trainer = L.Trainer(max_steps=N, devices=per_node, num_nodes=info.world_size // per_node,
                        strategy=DDPStrategy(process_group_backend=info.backend),
                        callbacks=[tw, tw.model_checkpoint(every_n_train_steps=50, save_top_k=3)])
    trainer.fit(module, train_dataloaders=tw.dataloader(train_ds, batch_size=32),
                ckpt_path=tw.ckpt_path())

What it does:

* **Data order.** ``tw.dataloader(ds, batch_size=...)`` hands out trainwarden's global batch
  order (the ``ResumableLoader`` order: global batch ``g`` is a pure function of seed, ``g``
  and rank; with ``accumulate_grad_batches=k`` a global batch is every rank's ``k``
  micro-batches of one optimiser step).  It starts at the resumed step's batch at once, never
  replays, and never hands out a batch of the plan's skip ranges.  Lightning's
  ``DistributedSampler`` is not involved (the loader is rank-aware itself).  Its iterator
  draws nothing from the global RNG (the DataLoader gets a generator of its own).
* **Checkpoints.** ``tw.model_checkpoint(...)`` is a ``ModelCheckpoint`` that writes
  ``<dir>/step_<N>/checkpoint.ckpt`` (the state after N optimiser steps), adds the per-rank RNG
  states and, once every rank is done, ``trainwarden.json`` (metadata and the size of every
  file): only then is it complete and reported to the agent.  Its top-k retention still picks
  what to drop, but nothing pinned (the supervisor protects it) is deleted, and nothing before
  ``retention_grace_s`` after it was dropped.  A plain ``ModelCheckpoint`` beside it is refused:
  it would delete protected checkpoints.
* **Resume.** ``tw.ckpt_path()`` reads ``TRAINWARDEN_RESUME_PLAN`` (the plan's checkpoint, else
  the newest complete one) for ``fit(ckpt_path=...)``, which restores model, optimiser, LR
  schedulers and loops; trainwarden positions the data and, right before the first resumed
  step, puts back every rank's RNG states as they were at the save (Lightning keeps none).
* **LR.** The plan's factor multiplies the LR the schedulers set, for the optimiser step only.
* **Reports.** Every optimiser step: step, loss (this rank's mean over its micro-batches), LR,
  grad norm, samples, data/compute/step times, the global batch index.
* **World size.** On fewer ranks than ``TRAINWARDEN_DECLARED_WORLD_SIZE`` declares,
  ``accumulate_grad_batches`` is multiplied by declared / running and each rank trains its
  consecutive share of the global batch's micro-batches, so a step trains the same global
  batch (the same samples, averaged the same way; equal up to summation order and dropout
  draws).  A world that cannot share the micro-batches evenly is refused with a
  ``ValueError`` before the first step.  A checkpoint written on another number of ranks
  resumes at the next global batch: Lightning's saved loop progress, which counts
  micro-batches of the accumulation it was written with, is set to the current one's.
* **Stop.** Under the trainwarden agent (``TRAINWARDEN_AGENT_SOCKET`` set), SIGTERM does what
  it did before ``fit`` (by default: the process ends at once), as in a hand-written loop.
  Lightning's own handler only sets a flag for the next batch and broadcasts it from inside
  the handler; the agent's stop sends each worker several SIGTERMs (it signals every process
  and process group of the tree, and torchrun forwards its own), and the extra broadcasts
  leave the ranks waiting on each other until the agent's SIGKILL after its grace period.
  The agent resumes from the newest complete checkpoint, so ending at once loses nothing that
  was saved (a save cut short has no manifest and is never resumed from).  Without the agent
  (a plain ``torchrun``), Lightning's handling is left as it is.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, default_collate

from trainwarden.agent.integrations._core import (
    OptimizerPlan,
    RunSession,
    StepRecord,
    accumulation_for,
    attach_grad_timer,
    report,
)
from trainwarden.agent.protocol import ENV_AGENT_SOCKET
from trainwarden.agent.worker.data import GlobalBatchOrder
from trainwarden.agent.worker.report import PhaseTimer, Reporter, training_done

log = logging.getLogger("trainwarden")

STEP_DIR = re.compile(r"^step_(\d+)$")
CKPT_FILE = "checkpoint.ckpt"


class _Tagged(Dataset[Any]):
    """``dataset[i]`` with the global batch index it is fetched for."""

    def __init__(self, dataset: Dataset[Any]) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        # (torch's Dataset declares no __len__; a map-style dataset has one)
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, Any]:
        g, i = key
        return g, self.dataset[i]


class _StepSampler:
    """Index lists for this rank's micro-batches of each step from ``start`` on, in global order.

    A global batch is the ``declared x full`` micro-batches of ``per`` samples the declared
    world trains in one step (``full``: the Trainer's own ``accumulate_grad_batches``), slot
    after slot; this rank trains the ``micro`` consecutive ones from ``rank x micro`` on.  On
    the full world that is its own slot, split into ``full`` micro-batches."""

    def __init__(self, order: GlobalBatchOrder, session: RunSession, start: int, *,
                 per: int, full: int, micro: int, issued: deque[tuple[int, int]]) -> None:
        self.order, self.session, self.start, self.issued = order, session, start, issued
        self.per, self.full, self.micro = per, full, micro

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.start
        first = self.order.rank * self.micro
        while True:
            g = self.session.batch_index(step)
            slot_indices: tuple[int, list[int]] = (-1, [])
            for j in range(first, first + self.micro):
                slot, m = divmod(j, self.full)
                if slot_indices[0] != slot:
                    slot_indices = (slot, self.order.slot_indices(g, slot))
                self.issued.append((step, g))
                yield [(g, i) for i in slot_indices[1][m * self.per:(m + 1) * self.per]]
            step += 1


class TrainwardenLoader:
    """The training data in trainwarden's global batch order, from the next step to train.

    ``transform(batch_index, batch)``, when given, sees each collated micro-batch with its
    global batch index (the examples corrupt chosen batches with it).  Iterating it builds a
    ``DataLoader`` (``num_workers`` as you like) that starts at the next step's batch."""

    def __init__(self, dataset: Dataset[Any], session: RunSession, *, batch_size: int,
                 shuffle: bool = True, num_workers: int = 0,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 transform: Callable[[int, Any], Any] | None = None) -> None:
        if not hasattr(dataset, "__len__") or isinstance(dataset,
                                                         torch.utils.data.IterableDataset):
            raise TypeError("TrainwardenCallback.dataloader needs a map-style dataset "
                            "(__len__ and __getitem__): an iterable one cannot be positioned "
                            "without reading it")
        if batch_size <= 0:
            raise ValueError("batch_size must be > 0")
        self.dataset = _Tagged(dataset)
        self.session, self.batch_size, self.shuffle = session, batch_size, shuffle
        self.num_workers = num_workers
        self.collate = collate_fn or default_collate
        self.transform = transform
        self.full_micro = 1  # the Trainer's accumulate_grad_batches: the full world's
        self.micro = 1  # the micro-batches this rank trains per step (more on fewer ranks)
        self._trained_to: int | None = None  # the next step once a step was trained
        self.issued: deque[tuple[int, int]] = deque()

    @property
    def next_step(self) -> int:
        """The step whose batch an iterator starts at: the resumed step, read from the
        session when iterated (so a loader made after ``tw.ckpt_path()`` starts there too),
        then the step after the last one trained."""
        if self._trained_to is not None:
            return self._trained_to
        return self.session.resumed.start_step

    @next_step.setter
    def next_step(self, step: int) -> None:
        self._trained_to = step

    def rewind(self) -> None:
        """Start again at the session's resumed step (a new resume was chosen)."""
        self._trained_to = None

    def _collate(self, items: list[tuple[int, Any]]) -> Any:
        g = items[0][0]
        batch = self.collate([s for _, s in items])
        return self.transform(g, batch) if self.transform is not None else batch

    def __iter__(self) -> Iterator[Any]:
        s = self.session
        order = GlobalBatchOrder(len(self.dataset), batch_size=self.batch_size * self.full_micro,
                                 rank=s.rank, world_size=s.world_size, seed=s.seed or 0,
                                 shuffle=self.shuffle, declared_world_size=s.declared_world_size)
        self.issued.clear()
        sampler = _StepSampler(order, s, self.next_step, per=self.batch_size,
                               full=self.full_micro, micro=self.micro, issued=self.issued)
        # A generator of its own: a DataLoader iterator otherwise draws its base seed from the
        # global RNG, which would shift every random stream after a resume.
        gen = torch.Generator().manual_seed(s.seed or 0)
        loader = DataLoader(self.dataset, batch_sampler=sampler,
                            num_workers=self.num_workers, collate_fn=self._collate,
                            generator=gen)
        return iter(loader)

    # Lightning's resumable-loader protocol: the position itself is the callback's (it is
    # restored from the checkpoint before the loader is iterated).
    def state_dict(self) -> dict[str, Any]:
        return {"next_step": self.next_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class TrainwardenModelCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` whose checkpoints the supervisor can know and protect (made by
    ``TrainwardenCallback.model_checkpoint``)."""

    def __init__(self, owner: TrainwardenCallback, **kwargs: Any) -> None:
        for k in ("dirpath", "filename", "save_last", "enable_version_counter",
                  "auto_insert_metric_name"):
            if k in kwargs:
                raise ValueError(f"TrainwardenCallback.model_checkpoint sets {k} itself "
                                 "(step_<N>/checkpoint.ckpt under the callback's directory)")
        kwargs.setdefault("save_top_k", owner.session.keep)
        if kwargs.get("monitor") is None:  # top-k without a metric: the newest k
            kwargs["monitor"], kwargs["mode"] = "step", "max"
        super().__init__(dirpath=str(owner.root), filename="step_{step}/checkpoint",
                         auto_insert_metric_name=False, enable_version_counter=False,
                         save_last=False, **kwargs)
        self.owner = owner
        self._to_remove: set[Path] = set()

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        s = self.owner.session
        path = Path(filepath).parent
        step = trainer.global_step
        s.save_starting(step, path)
        super()._save_checkpoint(trainer, filepath)
        s.finish_checkpoint(step, path)
        self.sweep()
        self.owner.timer.start()  # the save is not the next step's data wait

    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Top-k dropped it: deleted once the grace is over and no pin holds it."""
        self._to_remove.add(Path(filepath).parent)
        self.sweep()

    def sweep(self) -> None:
        s = self.owner.session
        if s.rank == 0 and self._to_remove:
            s.retention.apply(self._to_remove)
            self._to_remove = set(s.retention.since)


class TrainwardenCallback(Callback):
    """Reports, checkpoints the supervisor knows, exact resume and the resume plan for a
    Lightning ``Trainer``.  See the module's docstring for the lines to add.

    ``root``: the checkpoint directory; ``keep``: the default ``save_top_k``."""

    def __init__(self, root: str | Path, *, keep: int = 3, retention_grace_s: float = 30.0,
                 seed: int = 0, config: dict[str, Any] | None = None, grad_norm: bool = True,
                 reporter: Reporter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(root)
        self.session = RunSession(seed=seed, keep=keep, retention_grace_s=retention_grace_s,
                                  save_every_s=None, sync_every=1, config=config,
                                  reporter=reporter, clock=clock)
        self.loaders: list[TrainwardenLoader] = []
        self.checkpoints: list[TrainwardenModelCheckpoint] = []
        self.timer = PhaseTimer()
        self._step = 0
        self.optimizer_plan = OptimizerPlan(self.session, lambda: self._step,
                                            grad_norm=grad_norm)
        self._resumed = False
        self._full_accumulation: int | None = None  # the Trainer's own, for the full world
        self._full_val_check: int | float | None = None  # the Trainer's val_check_interval
        self._sigterm_before: Any = None  # SIGTERM's handler before Lightning installed its own
        self._first = True
        self._hooks: list[Any] = []
        self._loss: torch.Tensor | None = None
        self._samples = 0
        self._index = -1
        self.last: StepRecord | None = None

    @property
    def state_key(self) -> str:
        return "TrainwardenCallback"

    # ---- the user's lines -------------------------------------------------------------------
    def dataloader(self, dataset: Dataset[Any], *, batch_size: int, shuffle: bool = True,
                   num_workers: int = 0, collate_fn: Callable[[list[Any]], Any] | None = None,
                   transform: Callable[[int, Any], Any] | None = None) -> TrainwardenLoader:
        loader = TrainwardenLoader(dataset, self.session, batch_size=batch_size,
                                   shuffle=shuffle, num_workers=num_workers,
                                   collate_fn=collate_fn, transform=transform)
        self.loaders.append(loader)
        return loader

    def model_checkpoint(self, *, every_n_train_steps: int | None = None,
                         train_time_interval: timedelta | None = None,
                         **kwargs: Any) -> TrainwardenModelCheckpoint:
        cp = TrainwardenModelCheckpoint(self, every_n_train_steps=every_n_train_steps,
                                        train_time_interval=train_time_interval, **kwargs)
        self.checkpoints.append(cp)
        return cp

    def ckpt_path(self) -> str | None:
        """For ``trainer.fit(..., ckpt_path=...)``: the resume plan's checkpoint, else the newest
        complete one, else None.  Collective (call it on every rank)."""
        resumed = self.session.resume(self.root, STEP_DIR)
        self._resumed = True
        self._step = resumed.start_step
        for loader in self.loaders:
            loader.rewind()
        return str(resumed.checkpoint / CKPT_FILE) if resumed.checkpoint is not None else None

    @property
    def skipped(self) -> list[tuple[int, int]]:
        return list(self.session.skipped)

    # ---- Lightning hooks --------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        plain = [c for c in trainer.checkpoint_callbacks
                 if not isinstance(c, TrainwardenModelCheckpoint)]
        if plain:
            raise ValueError("a plain ModelCheckpoint would delete checkpoints the supervisor "
                             "protects: use callbacks=[tw, tw.model_checkpoint(...)] (and "
                             "enable_checkpointing only through it)")
        if trainer.max_steps is None or trainer.max_steps <= 0:
            raise ValueError("TrainwardenCallback needs Trainer(max_steps=N): the data loader "
                             "runs in steps, not epochs")
        if not self._resumed:
            raise RuntimeError("trainwarden: call trainer.fit(..., ckpt_path=tw.ckpt_path()): "
                               "it applies the resume plan and positions the data")
        self._keep_global_batch(trainer, pl_module)
        for loader in self.loaders:
            loader.full_micro = self._full_accumulation or trainer.accumulate_grad_batches
            loader.micro = trainer.accumulate_grad_batches
        # Lightning installs its SIGTERM handler after this hook and before on_train_start.
        self._sigterm_before = signal.getsignal(signal.SIGTERM)

    def _keep_global_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """On fewer ranks than the run declares, accumulate over more micro-batches so a step
        trains the declared world's global batch: the Trainer's accumulate_grad_batches (the
        full world's) x declared / running."""
        s = self.session
        if self._full_accumulation is None:
            self._full_accumulation = trainer.accumulate_grad_batches
        try:
            steps = accumulation_for(self._full_accumulation, world_size=s.world_size,
                                     declared=s.declared_world_size)
        except ValueError as e:
            raise ValueError(f"trainwarden's Lightning callback: {e}") from None
        if steps != self._full_accumulation and not pl_module.automatic_optimization:
            raise ValueError(
                f"trainwarden's Lightning callback: on {s.world_size} of the "
                f"{s.declared_world_size} ranks declared a step takes {steps} micro-batches, "
                "which Lightning accumulates for automatic optimization only: restart on the "
                "full world, or train with automatic optimization")
        if steps != trainer.accumulate_grad_batches:
            log.info("trainwarden: %d of %d declared ranks: accumulate_grad_batches %d -> %d "
                     "(the same global batch)", s.world_size, s.declared_world_size,
                     trainer.accumulate_grad_batches, steps)
            trainer.accumulate_grad_batches = steps
        # An int val_check_interval counts training micro-batches: validate after the same
        # optimiser steps as on the full world.
        if self._full_val_check is None:
            self._full_val_check = trainer.val_check_interval
        full = self._full_val_check
        if isinstance(full, int) and not isinstance(full, bool):
            batches, rest = divmod(full * steps, self._full_accumulation)
            if rest:
                raise ValueError(
                    f"trainwarden's Lightning callback: val_check_interval={full} training "
                    f"batches ({full}/{self._full_accumulation} optimiser steps) is no whole "
                    f"number of batches at {steps} per step on {s.world_size} of the "
                    f"{s.declared_world_size} ranks declared: give val_check_interval as a "
                    f"multiple of accumulate_grad_batches ({self._full_accumulation}), or "
                    "restart on the full world")
            trainer.val_check_interval = batches

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Lightning's saved loop progress counts the micro-batches trained so far, and the
        loop accumulates until that count is a multiple of ``accumulate_grad_batches``.  A
        checkpoint of another world size counts micro-batches of another accumulation (and a
        time-based save may fall inside a step), so the count is put where the current
        accumulation has it after the saved step: ``step x accumulate_grad_batches``.  The
        first step of this start then trains all its micro-batches, from the loader's first
        one (the next global batch).  A checkpoint of the same world, saved after its step,
        already has that count and is left as it is."""
        restore_progress(checkpoint, trainer.accumulate_grad_batches)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self.session.resumed.start_step:
            raise RuntimeError(
                f"trainwarden: Lightning is at step {trainer.global_step} but the checkpoint "
                f"chosen is at step {self.session.resumed.start_step}: pass "
                "ckpt_path=tw.ckpt_path() to trainer.fit()")
        self._restore_sigterm(trainer)
        self.optimizer_plan.attach(trainer.optimizers[0])
        self._hooks = attach_grad_timer(pl_module, self.timer)
        self._first = True
        self.timer.start()

    def _restore_sigterm(self, trainer: pl.Trainer) -> None:
        """Under the agent, SIGTERM ends the worker as it would have before ``fit`` (see the
        module's docstring); Lightning's teardown puts the same handler back after ``fit``."""
        if not os.environ.get(ENV_AGENT_SOCKET):
            return
        if threading.current_thread() is not threading.main_thread():
            return  # signal.signal works on the main thread only (Lightning skips it too)
        before = self._sigterm_before
        signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
        if trainer.received_sigterm:  # one came in between Lightning's handler and this hook
            signal.raise_signal(signal.SIGTERM)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        loader = self.loaders[0] if self.loaders else None
        step, index = loader.issued.popleft() if loader and loader.issued else (
            trainer.global_step, -1)
        if step != trainer.global_step:
            raise RuntimeError(f"trainwarden: the loader is at step {step}, Lightning at "
                               f"{trainer.global_step}")
        if self._first:
            self.session.restore_rng()
            self._first = False
        if step != self._step or self._index < 0:
            self._loss, self._samples = None, 0
        self._step, self._index = step, index
        self.timer.data_ready()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        try:
            loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
            if isinstance(loss, torch.Tensor):
                part = loss.detach().float()
                self._loss = part if self._loss is None else self._loss + part
            first = batch[0] if isinstance(batch, list | tuple) else batch
            if hasattr(first, "shape"):
                self._samples += int(first.shape[0])
        except Exception:
            pass
        if trainer.global_step == self._step:  # accumulating: the optimiser has not stepped
            return
        s = self.session
        s.trained(self._step, self._index)
        self.timer.stop()
        value = float(self._loss) if self._loss is not None else None
        s.last_loss = value
        self.last = StepRecord(self._step, self._index, self.optimizer_plan.lr, value)
        report(s, self.last, samples=self._samples or None, tokens=None,
               grad_norm=self.optimizer_plan.grad_norm, timer=self.timer)
        for loader in self.loaders:
            loader.next_step = trainer.global_step
        self._index = -1
        if s.rank == 0 and s.retention.pending():
            for cp in self.checkpoints:
                cp.sweep()
        self.timer.start()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.optimizer_plan.detach()
        training_done(reporter=self.session.reporter)


def restore_progress(checkpoint: dict[str, Any], accumulation: int) -> bool:
    """Set the training batch progress of a Lightning ``checkpoint`` (in place) to where
    ``accumulation`` micro-batches per step have it after the checkpoint's step, keeping the
    stage the save happened in (the offsets between the counters).  Returns whether it
    changed anything."""
    fit = (checkpoint.get("loops") or {}).get("fit_loop")
    if not fit or "epoch_loop.batch_progress" not in fit:
        return False
    progress = fit["epoch_loop.batch_progress"]
    step = int(checkpoint["global_step"])
    total, current = progress["total"], progress["current"]
    delta = step * accumulation - int(total["ready"])
    if delta == 0:
        return False
    if total != current:  # the loader has no length: one epoch, never reset within the run
        raise RuntimeError(
            f"trainwarden: checkpoint at step {step} holds batch progress {progress} with a "
            "current epoch's count other than the total, which this callback never writes")
    log.info("trainwarden: loop progress of step %d: %d micro-batches -> %d (%d per step)",
             step, total["ready"], step * accumulation, accumulation)
    for counts in (total, current):
        for key in ("ready", "started", "processed", "completed"):
            counts[key] = max(0, int(counts[key]) + delta)
    return True

"""trainwarden for the Hugging Face ``Trainer`` (``pip install trainwarden[hf]``).

    info = init_distributed(timeout=60)              # before TrainingArguments: the Trainer
    tw = TrainwardenCallback()                       # (accelerate) uses this process group
    args = TrainingArguments(output_dir=ckpt_dir, max_steps=N, save_steps=50,
                             save_total_limit=3, train_sampling_strategy="sequential",
                             ignore_data_skip=True, ...)
    trainer = Trainer(model=model, args=args, train_dataset=tw.dataset(train_ds),
                      callbacks=[tw])
    trainer.train(resume_from_checkpoint=tw.resume_from_checkpoint())

What it does:

* **Data order.** ``tw.dataset(ds)`` presents ``ds`` to the Trainer in trainwarden's global
  batch order: step ``s`` trains global batch ``g(s)``, the ``g``-th chunk of
  ``per_device_train_batch_size x world size x gradient_accumulation_steps`` samples of a
  seeded permutation of ``ds`` (a new permutation each pass).  The Trainer reads it in order
  (``train_sampling_strategy="sequential"``) and accelerate deals it out to the ranks as usual.
  Position ``i`` of a start of the script is a pure function of (seed, resumed step, data
  position, skip ranges), so a resume continues at the next batch at once, without replaying
  the batches before it (``ignore_data_skip=True``: the Trainer's own fast-forward is what
  replays them), and the plan's skip ranges are simply never handed out.  On fewer ranks
  than the run declares (``TRAINWARDEN_DECLARED_WORLD_SIZE``), ``gradient_accumulation_steps``
  is multiplied by declared / running, so a step still trains the same global batch (the
  same samples, averaged the same way; split differently into micro-batches, so equal up to
  summation order).  A world that cannot share the micro-batches evenly is refused.  This
  needs a map-style dataset (``__len__`` and ``__getitem__``); an ``IterableDataset`` cannot
  be positioned without reading it, so ``tw.dataset`` refuses one.
* **Checkpoints.** The Trainer writes ``checkpoint-N/`` as usual; trainwarden adds the per-rank
  RNG states and, once every rank has finished, ``trainwarden.json`` (metadata and the size of
  every file): only then is the checkpoint complete and reported to the agent.  The Trainer's
  own rotation is switched off (``save_total_limit`` is taken over as ``keep``): trainwarden
  keeps the newest ``keep`` complete checkpoints, the best one, every pinned one (the
  supervisor protects them), and deletes a surplus one only ``retention_grace_s`` after it fell
  out.
* **Resume.** ``tw.resume_from_checkpoint()`` reads ``TRAINWARDEN_RESUME_PLAN``: the plan's
  checkpoint (or, without a plan, the newest complete one), its skip ranges and LR schedule.
  The Trainer restores model, optimiser, scheduler and its own RNG files; right before the
  first resumed step trainwarden sets every rank's RNG states back to what they were at the
  save, because the Trainer draws from the global generator in between (a DataLoader iterator
  takes its base seed from it), which would shift dropout.
* **LR.** The plan's factor multiplies the LR the Trainer's scheduler set, for the step only
  (an optimiser step pre-hook; a post-hook puts the scheduler's value back).
* **Reports.** Every optimiser step: step, loss (this rank's, as the Trainer accumulates it),
  LR (with the plan's factor), grad norm, samples and tokens, data/compute/step times, the
  global batch index.  Never blocks, never raises into training.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from trainwarden.agent.integrations._core import (
    OptimizerPlan,
    RunSession,
    StepRecord,
    accumulation_for,
    attach_grad_timer,
    list_step_checkpoints,
    newest_surplus,
    report,
)
from trainwarden.agent.worker.data import GlobalBatchOrder
from trainwarden.agent.worker.report import PhaseTimer, Reporter, training_done

log = logging.getLogger("trainwarden")

CHECKPOINT_DIR = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR


class TrainwardenDataset(Dataset[Any]):
    """``dataset`` in trainwarden's global batch order, for a Trainer reading it in sequence.

    ``transform(batch_index, sample)``, when given, sees each sample with the global batch
    index it is trained in (the examples corrupt chosen batches with it)."""

    def __init__(self, dataset: Dataset[Any], session: RunSession, *, shuffle: bool = True,
                 transform: Callable[[int, Any], Any] | None = None) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(
                "TrainwardenCallback.dataset needs a map-style dataset (__len__ and "
                "__getitem__): an IterableDataset cannot be positioned without reading it, so "
                "neither an exact resume nor a skip range could avoid replaying batches")
        self.dataset, self.session, self.shuffle, self.transform = (
            dataset, session, shuffle, transform)
        self.per_step = 0  # samples of one global batch; set once the Trainer's args are known
        self.steps = 0
        self.order: GlobalBatchOrder | None = None
        self._indices: tuple[int, list[int]] = (-1, [])

    def configure(self, *, per_step: int, steps: int, seed: int) -> None:
        self.per_step, self.steps = per_step, steps
        self.order = GlobalBatchOrder(len(self.dataset), batch_size=per_step,
                                      rank=0, world_size=1, seed=seed, shuffle=self.shuffle)

    def __len__(self) -> int:
        if not self.per_step:
            return len(self.dataset)
        return self.steps * self.per_step

    def __getitem__(self, i: int) -> Any:
        if self.order is None:
            raise RuntimeError("TrainwardenDataset is read before its Trainer was created with "
                               "callbacks=[the TrainwardenCallback that made it]")
        k, offset = divmod(int(i), self.per_step)
        g = self.session.batch_index(self.session.resumed.start_step + k)
        if self._indices[0] != g:
            self._indices = (g, self.order.indices(g))
        sample = self.dataset[self._indices[1][offset]]
        return self.transform(g, sample) if self.transform is not None else sample


class TrainwardenCallback(TrainerCallback):
    """Reports, checkpoints the supervisor knows, exact resume and the resume plan for a
    Hugging Face ``Trainer``.  See the module's docstring for the lines to add.

    ``keep`` defaults to the Trainer's ``save_total_limit`` (3 when that is unset);
    ``save_every_s`` adds wall-clock saves to the Trainer's ``save_steps`` (ranks agree through
    one tiny all-reduce every ``sync_every`` steps); ``seed`` defaults to ``args.seed``."""

    def __init__(self, *, keep: int | None = None, retention_grace_s: float = 30.0,
                 save_every_s: float | None = None, sync_every: int = 10,
                 seed: int | None = None, config: dict[str, Any] | None = None,
                 grad_norm: bool = True, reporter: Reporter | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.session = RunSession(seed=seed, keep=keep or 1, retention_grace_s=retention_grace_s,
                                  save_every_s=save_every_s, sync_every=sync_every,
                                  config=config, reporter=reporter, clock=clock)
        self._keep = keep
        self._full_accumulation: int | None = None  # the arguments' own, for the full world
        self._datasets: list[TrainwardenDataset] = []
        self.root: Path | None = None
        self._resumed_called = False
        self._args: TrainingArguments | None = None
        self.timer = PhaseTimer()
        self.optimizer_plan = OptimizerPlan(self.session, lambda: self._step,
                                            grad_norm=grad_norm)
        self._step = 0
        self._first_step = True
        self._hooks: list[Any] = []
        self._loss: torch.Tensor | None = None
        self._samples = 0
        self._tokens: torch.Tensor | int = 0
        self.last: StepRecord | None = None  # the step just trained (for scripts that log it)

    # ---- the user's lines -------------------------------------------------------------------
    def dataset(self, dataset: Dataset[Any], *, shuffle: bool = True,
                transform: Callable[[int, Any], Any] | None = None) -> TrainwardenDataset:
        """The training set in trainwarden's order (pass it as ``train_dataset``)."""
        ds = TrainwardenDataset(dataset, self.session, shuffle=shuffle, transform=transform)
        self._datasets.append(ds)
        return ds

    def resume_from_checkpoint(self) -> str | None:
        """The checkpoint to pass to ``trainer.train(resume_from_checkpoint=...)``: the resume
        plan's, else the newest complete one under ``output_dir``, else None.  Collective."""
        if self.root is None:
            raise RuntimeError("create the Trainer with callbacks=[this callback] before "
                               "calling resume_from_checkpoint()")
        resumed = self.session.resume(self.root, CHECKPOINT_DIR)
        self._resumed_called = True
        self._step = resumed.start_step
        return str(resumed.checkpoint) if resumed.checkpoint is not None else None

    @property
    def skipped(self) -> list[tuple[int, int]]:
        """Global batch ranges this run passed over (from every attempt)."""
        return list(self.session.skipped)

    # ---- Trainer events ---------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        _check_args(args)
        self._args = args
        self.root = Path(args.output_dir or ".")
        s = self.session
        if s.seed is None:
            s.seed = args.seed
        if args.save_total_limit is not None:
            # The Trainer's rotation deletes the oldest checkpoint-* whatever protects it; ours
            # honours pins and the grace.  Same number kept.
            log.info("trainwarden: taking over save_total_limit=%d (keep %d, pinned ones and "
                     "a %gs grace)", args.save_total_limit, args.save_total_limit,
                     s.retention.grace_s)
            s.keep = self._keep or args.save_total_limit
            args.save_total_limit = None
        else:
            s.keep = self._keep or 3
        self._keep_global_batch(args)
        per_step = (args.per_device_train_batch_size * max(1, args.world_size)
                    * args.gradient_accumulation_steps)
        for ds in self._datasets:
            ds.configure(per_step=per_step, steps=args.max_steps, seed=s.seed)

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        if not self._resumed_called:
            raise RuntimeError("trainwarden: start training with trainer.train("
                               "resume_from_checkpoint=tw.resume_from_checkpoint()): it applies "
                               "the resume plan and positions the data")
        if state.global_step != self.session.resumed.start_step:
            raise RuntimeError(
                f"trainwarden: the Trainer is at step {state.global_step} but the checkpoint "
                f"chosen is at step {self.session.resumed.start_step}: pass "
                "resume_from_checkpoint=tw.resume_from_checkpoint() to trainer.train()")
        model = kwargs["model"]
        self.optimizer_plan.attach(kwargs["optimizer"])
        self._hooks = [model.register_forward_hook(self._forward_hook, with_kwargs=True),
                       *attach_grad_timer(model, self.timer)]
        self._first_step = True
        self.timer.start()

    def on_step_begin(self, args: TrainingArguments, state: TrainerState,
                      control: TrainerControl, **kwargs: Any) -> None:
        self._step = state.global_step
        if self._first_step:
            self.session.restore_rng()
            self._first_step = False
        self._loss, self._samples, self._tokens = None, 0, 0
        self.timer.data_ready()  # the Trainer fetched this step's batches before the event

    def on_step_end(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        s = self.session
        step = state.global_step - 1
        index = s.batch_index(step)
        s.trained(step, index)
        self.timer.stop()
        loss = float(self._loss) if self._loss is not None else None
        s.last_loss = loss
        tokens = int(self._tokens)
        self.last = StepRecord(step, index, self.optimizer_plan.lr, loss)
        report(s, self.last, samples=self._samples or None, tokens=tokens or None,
               grad_norm=self.optimizer_plan.grad_norm, timer=self.timer)
        if s.save_due(state.global_step):
            control.should_save = True
        if control.should_save:
            s.save_starting(state.global_step, self._checkpoint_path(state.global_step))
        elif s.rank == 0 and s.retention.pending():
            s.retention.apply(self._surplus(state))
        self.timer.start()

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        self.session.finish_checkpoint(state.global_step,
                                       self._checkpoint_path(state.global_step),
                                       surplus=lambda: self._surplus(state))
        self.timer.start()

    def on_evaluate(self, args: TrainingArguments, state: TrainerState,
                    control: TrainerControl, **kwargs: Any) -> None:
        self.timer.start()  # evaluation is not the next step's data wait

    def on_train_end(self, args: TrainingArguments, state: TrainerState,
                     control: TrainerControl, **kwargs: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.optimizer_plan.detach()
        training_done(reporter=self.session.reporter)

    # ---- helpers ----------------------------------------------------------------------------
    def _keep_global_batch(self, args: TrainingArguments) -> None:
        """On fewer ranks than the run declares, accumulate over more micro-batches so a step
        trains the declared world's global batch: the arguments' gradient_accumulation_steps
        (the full world's) x declared / running."""
        world = max(1, args.world_size)
        if self._full_accumulation is None:
            self._full_accumulation = args.gradient_accumulation_steps
        steps = accumulation_for(self._full_accumulation, world_size=world,
                                 declared=self.session.declared_world_size)
        if steps != args.gradient_accumulation_steps:
            log.info("trainwarden: %d of %d declared ranks: gradient_accumulation_steps %d -> "
                     "%d (the same global batch)", world, self.session.declared_world_size,
                     args.gradient_accumulation_steps, steps)
            args.gradient_accumulation_steps = steps

    def _checkpoint_path(self, step: int) -> Path:
        assert self.root is not None
        return self.root / f"checkpoint-{step}"

    def _surplus(self, state: TrainerState) -> set[Path]:
        assert self.root is not None
        best = [Path(state.best_model_checkpoint)] if state.best_model_checkpoint else []
        return newest_surplus(list_step_checkpoints(self.root, CHECKPOINT_DIR),
                              self.session.keep, best)

    def _forward_hook(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any],
                      output: Any) -> None:
        """This rank's share of the step's loss as the Trainer accumulates it: a loss
        normalised by ``num_items_in_batch`` (tokens over every micro-batch and, with
        ``average_tokens_across_devices``, every rank) counts as is (times the world size in
        the latter case), a per-batch mean counts 1 / gradient_accumulation_steps."""
        try:
            if not module.training or not torch.is_grad_enabled():
                return
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss",
                                                                               None)
            ids = kwargs.get("input_ids")
            if ids is not None and hasattr(ids, "shape"):
                self._samples += int(ids.shape[0])
                mask = kwargs.get("attention_mask")
                self._tokens += mask.sum() if mask is not None else int(ids.numel())
            if loss is None or self._args is None:
                return
            a = self._args
            if kwargs.get("num_items_in_batch") is not None:
                scale = float(self.session.world_size) if (
                    a.average_tokens_across_devices and self.session.world_size > 1) else 1.0
            else:
                scale = 1.0 / a.gradient_accumulation_steps
            part = loss.detach().float() * scale
            self._loss = part if self._loss is None else self._loss + part
        except Exception:  # reporting never breaks training
            log.debug("trainwarden: loss hook failed", exc_info=True)


def _check_args(args: TrainingArguments) -> None:
    """The settings the data order and resume rely on; ValueError names the fix."""
    problems = []
    if args.max_steps is None or args.max_steps <= 0:
        problems.append("max_steps=N (the data order is laid out for a known number of steps)")
    if args.train_sampling_strategy != "sequential":
        problems.append('train_sampling_strategy="sequential" (trainwarden\'s dataset wrapper '
                        "owns the order; a random sampler would shuffle it again)")
    if not args.ignore_data_skip:
        problems.append("ignore_data_skip=True (the wrapper starts at the resumed batch; the "
                        "Trainer's fast-forward would replay and skip batches on top)")
    if args.auto_find_batch_size:
        problems.append("auto_find_batch_size=False (the batch size is part of the data order)")
    if str(getattr(args.save_strategy, "value", args.save_strategy)) in ("epoch", "best"):
        problems.append('save_strategy="steps" (or "no" with save_every_s): one Trainer epoch '
                        "spans the whole run here")
    if problems:
        raise ValueError("TrainwardenCallback needs TrainingArguments(" + ", ".join(problems)
                         + ")")

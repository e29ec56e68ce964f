"""A PyTorch Lightning run (a LightningModule on the teacher task of ``train_ddp.py``) made
supervisable by trainwarden.

    torchrun --nproc_per_node=2 examples/lightning_module.py --steps 600 --checkpoint-dir /tmp/ck

CPU/gloo by default (Lightning's DDP strategy), CUDA/NCCL where available.  Takes the flags of
``train_ddp.py``.
"""

from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta
from typing import Any

import common
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from train_ddp import build_model

from trainwarden.agent.integrations.lightning import TrainwardenCallback
from trainwarden.agent.worker import init_distributed
from trainwarden.agent.worker.faults import FaultInjector


class Regression(pl.LightningModule):
    def __init__(self, hidden: int, lr: float, step_sleep: float, fsdp: bool = False,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.fsdp = fsdp
        self.net = build_model(hidden)
        self.drop = torch.nn.Dropout(dropout)  # random numbers every step: resume must restore RNG
        self.lr, self.step_sleep = lr, step_sleep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.drop(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
                      ) -> torch.Tensor:
        x, y = batch
        if self.step_sleep:
            time.sleep(self.step_sleep)
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_model(self) -> None:
        if self.fsdp:  # FSDP2, a shard per layer (Lightning's ModelParallelStrategy)
            from torch.distributed.fsdp import fully_shard

            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=self.device_mesh["data_parallel"])

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class ExampleHooks(pl.Callback):
    """The example's own per-step work: injected process faults and the batch log."""

    def __init__(self, tw: TrainwardenCallback, faults: FaultInjector,
                 log: common.BatchLog) -> None:
        self.tw, self.faults, self.batch_log = tw, faults, log
        self.logged = -1

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.faults.before_step(trainer.global_step)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        # Once per optimiser step (a step is several micro-batches with accumulation).
        last = self.tw.last
        if last is not None and last.step == trainer.global_step - 1 and last.step != self.logged:
            self.logged = last.step
            self.batch_log.write(last.step, last.batch_index, last.lr or 0.0)
            self.faults.slowdown(last.step, self.tw.timer.compute_s or 0.0)


def own_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard per layer) through "
                   "Lightning's ModelParallelStrategy; its FSDPStrategy (FSDP1) refuses the CPU")
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout probability on the input (0: no random draws that a resize "
                   "changes, so a run on fewer ranks can end bit-identical)")


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], own_flags)
    if args.async_checkpoint:
        raise SystemExit("--async-checkpoint: Lightning's ModelCheckpoint saves synchronously")
    torch.set_num_threads(1)
    info = init_distributed(timeout=args.timeout)  # before the Trainer: Lightning uses it
    common.setup_logging(info.rank)
    faults = FaultInjector(args.inject, rank=info.rank, world_size=info.world_size,
                           fired_dir=args.checkpoint_dir)

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    module = Regression(args.hidden, args.lr, args.step_sleep, fsdp=args.fsdp,
                        dropout=args.dropout)
    tw = TrainwardenCallback(args.checkpoint_dir, keep=args.keep,
                             retention_grace_s=args.retention_grace, seed=args.seed,
                             config=vars(args) | {"inject": [str(f) for f in args.inject]})
    every = (timedelta(seconds=args.checkpoint_every) if args.checkpoint_every else None)
    checkpoints = tw.model_checkpoint(every_n_train_steps=args.checkpoint_every_steps,
                                      train_time_interval=every)
    cuda = torch.cuda.is_available()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # torchrun's --nproc_per_node
    trainer = pl.Trainer(
        max_steps=args.steps, accelerator="gpu" if cuda else "cpu", devices=per_node,
        num_nodes=info.world_size // per_node,
        strategy=ModelParallelStrategy(data_parallel_size=info.world_size,
                                       tensor_parallel_size=1) if args.fsdp
        else DDPStrategy(process_group_backend=info.backend),
        callbacks=[tw, checkpoints, ExampleHooks(tw, faults, common.BatchLog(args.batch_log,
                                                                             info.rank))],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, gradient_clip_val=None)
    common.declare_flops(module.net, args)
    data = tw.dataloader(common.make_data(args.seed, 16_384, split=0),
                         batch_size=args.batch_size,
                         transform=lambda g, batch: faults.corrupt(g, *batch))

    t_start = time.time()
    ckpt_path = tw.ckpt_path()
    start = tw.session.resumed.start_step
    trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)

    last_loss = tw.last.loss if tw.last is not None and tw.last.loss is not None else float("nan")
    final_train = common.mean_over_ranks(last_loss)
    held_out = common.make_data(args.seed, 1024, split=1)
    final_eval = common.eval_loss(module.net, held_out, torch.device("cpu"))
    digest = common.weights_sha256(module.net)
    common.write_summary(args.summary_json, final_step=args.steps, final_train_loss=final_train,
                         final_eval_loss=final_eval, weights_sha256=digest,
                         attempt=info.attempt, started_at_step=start, resumed_from=ckpt_path,
                         world_size=info.world_size,
                         declared_world_size=info.declared_world_size,
                         accumulate_grad_batches=trainer.accumulate_grad_batches,
                         skipped=[list(r) for r in tw.skipped], wall_s=time.time() - t_start)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

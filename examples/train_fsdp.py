"""Fully sharded data-parallel training (FSDP2, ``fully_shard`` per block) under trainwarden.

    torchrun --nproc_per_node=2 examples/train_fsdp.py --steps 600 --checkpoint-dir /tmp/ckpt

Parameters, gradients and optimiser state are sharded across ranks; checkpoints are DCP
shards, one per rank.  CPU/gloo by default, CUDA/NCCL where available.

``--replicate R`` trains HSDP instead: R replicas, each sharded over world/R ranks (a 2-D
mesh, ``replicate`` x ``shard``).  The ranks that hold the same shard in different replicas
compare their fingerprints every ``--fingerprint-every`` steps (silent data corruption); plain
FSDP has no two ranks holding the same shard, so nothing to compare.

On fewer ranks than the run declares (``TRAINWARDEN_DECLARED_WORLD_SIZE=2 torchrun
--nproc_per_node=1 ...`` from a 2-rank run's checkpoint directory) each rank trains its share
of the same global batch as weighted micro-batches, and the run goes on as on the full world.
"""

from __future__ import annotations

import time

import common
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trainwarden.agent.worker import (
    Checkpointer,
    PhaseTimer,
    ResumableLoader,
    init_distributed,
    report_step,
    resume,
)
from trainwarden.agent.worker.faults import FaultInjector
from trainwarden.agent.worker.fingerprint import Fingerprints


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.ff = torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.GELU(),
                                      torch.nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class Model(torch.nn.Module):
    def __init__(self, hidden: int, depth: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(common.IN_DIM, hidden)
        self.blocks = torch.nn.ModuleList(Block(hidden) for _ in range(depth))
        self.out = torch.nn.Linear(hidden, common.OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


def main() -> None:
    args = common.parse_args(__doc__.splitlines()[0], extra=lambda p: p.add_argument(
        "--replicate", type=int, default=1, metavar="R",
        help="HSDP: R replicas, each sharded over world/R ranks (1: plain FSDP)"))
    torch.set_num_threads(1)
    info = init_distributed(timeout=args.timeout)
    common.setup_logging(info.rank)
    torch.manual_seed(args.seed)

    replicate = args.replicate
    if replicate > 1:  # HSDP: replicas of a sharded model
        if info.world_size % replicate:
            raise ValueError(f"--replicate {replicate} does not divide {info.world_size} ranks")
        mesh = init_device_mesh(info.device.type, (replicate, info.world_size // replicate),
                                mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(info.device.type, (info.world_size,))
    model = Model(args.hidden).to(info.device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # The ranks holding the same shard in each replica compare them (plain FSDP: no two
    # ranks hold the same shard, nothing to compare).
    fingerprints = (Fingerprints(model, every=args.fingerprint_every,
                                 group=mesh.get_group("replicate")) if replicate > 1 else None)
    loader = ResumableLoader(common.make_data(args.seed, 16_384, split=0),
                             batch_size=args.batch_size, rank=info.rank,
                             world_size=info.world_size, seed=args.seed,
                             collate_fn=common.collate)
    ckpt = Checkpointer(args.checkpoint_dir, model, optimizer, loader=loader,
                        interval_s=args.checkpoint_every, every_steps=args.checkpoint_every_steps,
                        keep=args.keep, retention_grace_s=args.retention_grace,
                        async_save=args.async_checkpoint, seed=args.seed,
                        fingerprints=fingerprints,
                        config=vars(args) | {"inject": [str(f) for f in args.inject]})
    start = resume(ckpt)
    faults = FaultInjector(args.inject, rank=info.rank, world_size=info.world_size,
                           fired_dir=args.checkpoint_dir)
    common.declare_flops(model, args)
    log = common.BatchLog(args.batch_log, info.rank)
    held_out = common.make_data(args.seed, 1024, split=1)
    timer = PhaseTimer()

    batches = iter(loader)
    loss_value = float("nan")
    losses = [loss_value]  # this rank's micro-batch losses of the last step trained
    evals: dict[str, float] = {}
    t_start = time.time()
    for step in range(start, args.steps):
        timer.start()
        batch = next(batches)
        timer.data_ready()
        faults.before_step(step)
        lr = args.lr * ckpt.lr_factor(step)
        for group in optimizer.param_groups:
            group["lr"] = lr

        t_compute = time.perf_counter()
        losses = []
        samples = 0
        # One part on the full world; on fewer ranks than declared, this rank's micro-batches
        # of the global batch, each loss weighted so the update is the full world's.
        for part in batch.parts(model):
            x, y = faults.corrupt(batch.index, *part.data)
            x, y = x.to(info.device), y.to(info.device)
            loss = torch.nn.functional.mse_loss(model(x), y)
            if args.step_sleep:
                time.sleep(args.step_sleep)
            if part.last:
                faults.slowdown(step, time.perf_counter() - t_compute)
                # FSDP gathers parameters inside forward, so "compute before the collective"
                # is the forward pass here (it includes the all-gathers); DDP measures it more
                # sharply.
                timer.compute_done()
            part.weighted(loss).backward()  # the gradient reduce-scatter runs on the last part
            losses.append(loss.item())
            samples += len(x)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        faults.after_step(step, model)
        if fingerprints is not None:
            fingerprints.maybe_check(step + 1)
        timer.stop()

        loss_value = sum(losses) / len(losses)  # the mean over this rank's micro-batches
        log.write(step, batch.index, lr)
        report_step(step, loss=loss_value, samples=samples, lr=lr,
                    grad_norm=grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor")
                    else grad_norm, timer=timer, batch_index=batch.index)
        if step + 1 in args.eval_at:
            evals[str(step + 1)] = common.eval_loss(model, held_out, info.device)
        if ckpt.due(step + 1):
            ckpt.save(step + 1, loss=loss_value)
    ckpt.close()

    final_train = common.mean_over_slots(sum(losses), len(losses))
    final_eval = common.eval_loss(model, held_out, info.device, extra_s=args.eval_sleep)
    digest = common.weights_sha256(model)
    common.write_summary(args.summary_json, final_step=args.steps, final_train_loss=final_train,
                         final_eval_loss=final_eval, eval_at=evals, weights_sha256=digest,
                         attempt=info.attempt, started_at_step=start,
                         world_size=info.world_size, declared_world_size=info.declared_world_size,
                         resumed_from=ckpt.resumed_from,
                         skipped=[list(r) for r in loader.skipped], wall_s=time.time() - t_start)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

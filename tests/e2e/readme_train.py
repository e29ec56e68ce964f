"""A training script as a new user writes it from the README: the loop of "3. Add a few lines
to train.py" copied line for line (``tests/e2e/test_resume.py`` checks that it still is), around
a model and data that draw from every global RNG: dropout and input noise (torch), a random
crop (Python ``random``) and additive noise (NumPy) in the dataset.

    torchrun --nproc_per_node=2 tests/e2e/readme_train.py --wrap ddp|fsdp --steps N \
        --checkpoint-dir DIR --checkpoint-every SECONDS [--kill-after-checkpoint K] \
        [--key-error-at-step K] --summary-json PATH

Lines added to the README's (none changed but one): what the README leaves to the user
(``build_model``, ``dataset``, ``loss_fn``, ``args``, ``base_lr``, ``n``, ``n_params`` and
``optimizer``, which needs the wrapped model), the summary at the end, and
``dist.destroy_process_group()`` (the README's "Exit" paragraph).  The one changed line: the
README's ``interval_s=600`` is ``interval_s=args.checkpoint_every``, so that a short test run
saves checkpoints on time, as the README's loop does.  ``DDP`` is torch's for ``--wrap ddp`` and
``fully_shard`` per block for ``--wrap fsdp``.  The crash a test injects comes from inside
``loss_fn`` (see there), so the loop stays the README's.
"""

# The README's lines are kept verbatim: its import layout and its one-line statements.
# ruff: noqa: E702, I001
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import signal
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from trainwarden.agent.worker import (Checkpointer, PhaseTimer, ResumableLoader,
                                      attach_compute_timer, declare_flops, init_distributed,
                                      report_step, resume)

IN_DIM, OUT_DIM, WIDTH = 16, 4, 32

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--wrap", choices=["ddp", "fsdp"], required=True)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--seed", type=int, default=0)
p.add_argument("--checkpoint-dir", required=True)
p.add_argument("--checkpoint-every", type=float, default=0.2, metavar="SECONDS")
p.add_argument("--kill-after-checkpoint", type=int, default=None, metavar="K")
p.add_argument("--key-error-at-step", type=int, default=None, metavar="K")
p.add_argument("--summary-json", default=None)
args = p.parse_args()
torch.set_num_threads(1)
torch.manual_seed(args.seed)
random.seed(args.seed)
np.random.seed(args.seed)
base_lr = 3e-3
n = 32


class AugmentedData(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A fixed regression set; each sample is randomly cropped (shifted) with Python's
    ``random`` and jittered with NumPy's global RNG as it is loaded."""

    def __init__(self, size: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(size, IN_DIM, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(IN_DIM, OUT_DIM, generator=g))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.roll(self.x[i], random.randint(0, 3))
        x = x + torch.from_numpy(np.random.normal(0.0, 0.05, IN_DIM).astype(np.float32))
        return x, self.y[i]


class InputNoise(torch.nn.Module):
    """Gaussian input noise from torch's global RNG while training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.1 * torch.randn_like(x) if self.training else x


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ff = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(),
                                      torch.nn.Dropout(0.2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.noise = InputNoise()
        self.inp = torch.nn.Linear(IN_DIM, WIDTH)
        self.blocks = torch.nn.ModuleList(Block() for _ in range(2))
        self.drop = torch.nn.Dropout(0.1)
        self.out = torch.nn.Linear(WIDTH, OUT_DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(self.noise(x))
        for block in self.blocks:
            h = block(h)
        return self.out(self.drop(h))


def build_model() -> Net:
    return Net()


def shard_per_block(model: Net) -> Net:
    mesh = init_device_mesh(info.device.type, (info.world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


DDP: Any = DistributedDataParallel if args.wrap == "ddp" else shard_per_block

dataset = AugmentedData(4096)
_calls = 0
_first_checkpoint_seen_at: int | None = None


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE; with ``--kill-after-checkpoint K`` rank 1 SIGKILLs itself, in torchrun's first
    attempt, K steps after it first sees a complete checkpoint (whatever the machine's speed,
    the crash comes between two time-based checkpoints)."""
    global _calls, _first_checkpoint_seen_at
    step_now, _calls = start + _calls, _calls + 1
    if (args.kill_after_checkpoint is not None and info.rank == 1
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
        root = Path(args.checkpoint_dir)
        if _first_checkpoint_seen_at is None and root.is_dir() and any(
                re.fullmatch(r"step_\d+", c.name) for c in root.iterdir()):
            _first_checkpoint_seen_at = step_now
        if (_first_checkpoint_seen_at is not None
                and step_now >= _first_checkpoint_seen_at + args.kill_after_checkpoint):
            os.kill(os.getpid(), signal.SIGKILL)
    if args.key_error_at_step is not None and info.rank == 1 and step_now == args.key_error_at_step:
        label_of({"input": out})  # a deterministic bug: every attempt, at the same step
    return torch.nn.functional.mse_loss(out, target)


def label_of(sample: dict[str, Any]) -> Any:
    """A helper with a bug (``--key-error-at-step``): the sample has no "label"."""
    return sample["label"]


# ---- from here to ckpt.close(): the README's lines ------------------------------------------
info = init_distributed(timeout=60)          # explicit collective timeout; works across restarts
model = DDP(build_model().to(info.device))
optimizer = torch.optim.AdamW(model.parameters(), lr=base_lr)
n_params = sum(p.numel() for p in model.parameters())
declare_flops(flops_per_token=6 * n_params, peak_flops_per_rank=989e12)  # optional: MFU
timer = PhaseTimer(); attach_compute_timer(model, timer)   # per-rank compute before the all-reduce
loader = ResumableLoader(dataset, batch_size=32, rank=info.rank,
                         world_size=info.world_size, seed=args.seed)
ckpt = Checkpointer(args.checkpoint_dir, model, optimizer, loader=loader,
                    interval_s=args.checkpoint_every, keep=3, seed=args.seed, config=vars(args))
start = resume(ckpt)                         # newest complete checkpoint, or the resume plan's
batches = iter(loader)
for step in range(start, args.steps):
    timer.start()
    batch = next(batches)                    # batch.index: the global batch index
    timer.data_ready()
    for g in optimizer.param_groups:
        g["lr"] = base_lr * ckpt.lr_factor(step)   # the plan's LR schedule (1.0 without one)
    loss = loss_fn(model(batch.data[0]), batch.data[1]); loss.backward()
    optimizer.step(); optimizer.zero_grad()
    timer.stop()
    report_step(step, loss=loss.item(), samples=n, lr=g["lr"], timer=timer,  # n: this rank's
                batch_index=batch.index)
    if ckpt.due(step + 1):
        ckpt.save(step + 1, loss=loss.item())
ckpt.close()
# ---- end of the README's lines ---------------------------------------------------------------

full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                            cpu_offload=True))
if info.rank == 0 and args.summary_json:
    h = hashlib.sha256()
    for key in sorted(full):
        h.update(key.encode())
        h.update(full[key].detach().contiguous().numpy().tobytes())
    with open(args.summary_json, "w") as f:
        json.dump({"weights_sha256": h.hexdigest(), "final_loss": loss.item(),
                   "started_at_step": start, "resumed_from": ckpt.resumed_from,
                   "model_class": type(model).__name__}, f)
dist.destroy_process_group()

"""How the barrier, data-loader and mismatch dumps here were made (a real 2-rank hang).

    torchrun --nproc_per_node=2 --standalone capture_stuck.py barrier|mismatch OUTDIR

then ``kill -USR1`` each worker (the library's faulthandler writes its stacks to
``OUTDIR/rank<R>.err``).  ``barrier``: rank 0 in ``dist.barrier()``, rank 1 stuck in a
dataset's ``__getitem__`` under ``ResumableLoader``; ``mismatch``: rank 0 in ``all_reduce``,
rank 1 in ``broadcast``.  (The dumps were taken with this file at /tmp/decide-cap/stuck.py.)
"""
# ruff: noqa: E402
import os
import sys
import time

out = sys.argv[2]
r = int(os.environ["RANK"])
f = open(os.path.join(out, f"rank{r}.err"), "w", buffering=1)  # noqa: SIM115
os.dup2(f.fileno(), 2)  # before init_distributed registers faulthandler on fd 2

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from trainwarden.agent.worker import ResumableLoader, init_distributed

info = init_distributed(timeout=300)
mode = sys.argv[1]


class SlowData(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        if r == 1:
            while True:  # a data source that never answers
                time.sleep(3600)
        return torch.zeros(4)

t = torch.ones(4)
if mode == "barrier":
    if r == 0:
        dist.barrier()
    else:
        next(iter(ResumableLoader(SlowData(), batch_size=4, rank=r, world_size=2, seed=0)))
elif mode == "mismatch":
    if r == 0:
        dist.all_reduce(t)
    else:
        dist.broadcast(t, src=0)

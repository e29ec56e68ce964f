"""What both example scripts share: arguments, synthetic data, evaluation, the run summary.

The task is regression onto a fixed random "teacher" network; data and the held-out set are
generated from ``--seed``, so nothing is downloaded and two runs are comparable.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

from trainwarden.agent.worker import declare_flops as worker_declare_flops
from trainwarden.agent.worker.faults import Fault, parse_fault
from trainwarden.agent.worker.fingerprint import DEFAULT_EVERY

IN_DIM, OUT_DIM = 32, 8


def parse_args(description: str,
               extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """The flags every example takes (``extra`` adds a script's own)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=600, help="optimiser steps in total")
    p.add_argument("--batch-size", type=int, default=32,
                   help="per micro-batch slot: per rank on the run's full world")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--checkpoint-dir", default="checkpoints")
    p.add_argument("--checkpoint-every", type=float, default=None, metavar="SECONDS",
                   help="save on wall-clock time")
    p.add_argument("--checkpoint-every-steps", type=int, default=None, metavar="N")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep")
    p.add_argument("--retention-grace", type=float, default=30.0, metavar="SECONDS",
                   help="a checkpoint beyond --keep is deleted this long after it fell out")
    p.add_argument("--async-checkpoint", action="store_true")
    p.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    p.add_argument("--summary-json", default=None, metavar="PATH")
    p.add_argument("--eval-at", type=_steps, default=(), metavar="N[,N...]",
                   help="also evaluate on the held-out set after N steps (the summary's "
                        "eval_at: those this start of the script passed)")
    p.add_argument("--batch-log", default=None, metavar="DIR",
                   help="append 'attempt step batch_index lr' per trained step, per rank")
    p.add_argument("--step-sleep", type=float, default=0.0, metavar="SECONDS",
                   help="extra compute time per step (to mimic a bigger model)")
    p.add_argument("--eval-sleep", type=float, default=0.0, metavar="SECONDS",
                   help="extra time in the final evaluation (to mimic a large held-out set)")
    p.add_argument("--inject", action="append", default=[], type=_fault,
                   metavar="KIND@STEP[:rank=R][:len=L]",
                   help="crash, hang, slow, spike, nan or bitflip[:bit=exponent|mantissa]"
                        "[:node=NAME]")
    p.add_argument("--fingerprint-every", type=int, default=DEFAULT_EVERY, metavar="N",
                   help="compare the replicas' parameter fingerprints every N steps")
    p.add_argument("--peak-tflops", type=float, default=None, metavar="TFLOPS",
                   help="peak TFLOP/s of one rank's device: declared with the model's FLOPs "
                        "per sample so the supervisor shows MFU")
    if extra is not None:
        extra(p)
    args = p.parse_args()
    if args.checkpoint_every is None and args.checkpoint_every_steps is None:
        args.checkpoint_every_steps = 50
    return args


def declare_flops(model: torch.nn.Module, args: argparse.Namespace) -> None:
    """With ``--peak-tflops``: declare ~6 x parameters FLOPs per sample (forward 2, backward
    4 per weight) and the peak, for the supervisor's MFU."""
    if args.peak_tflops is None:
        return
    if args.peak_tflops <= 0:
        raise SystemExit(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    params = sum(p.numel() for p in model.parameters())
    worker_declare_flops(flops_per_sample=6.0 * params,
                         peak_flops_per_rank=args.peak_tflops * 1e12)


def _steps(spec: str) -> tuple[int, ...]:
    try:
        steps = tuple(int(x) for x in spec.split(",") if x)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--eval-at {spec!r}: expected N[,N...]") from None
    if any(n < 1 for n in steps):
        raise argparse.ArgumentTypeError(f"--eval-at {spec!r}: steps must be >= 1")
    return steps


def _fault(spec: str) -> Fault:
    try:
        return parse_fault(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def setup_logging(rank: int) -> None:
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(message)s")


def _teacher(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(10_000 + seed)
    net = torch.nn.Sequential(torch.nn.Linear(IN_DIM, 64), torch.nn.Tanh(),
                              torch.nn.Linear(64, OUT_DIM))
    with torch.no_grad():
        for p in net.parameters():  # unit-scale targets, a smooth function to learn
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in**0.5))
    return net


def make_data(seed: int, n: int, split: int) -> TensorDataset:
    """``n`` samples of the teacher task; ``split`` 0 is training data, 1 the held-out set."""
    g = torch.Generator().manual_seed(seed * 7 + split)
    x = torch.randn(n, IN_DIM, generator=g)
    with torch.no_grad():
        y = _teacher(seed)(x) + 0.05 * torch.randn(n, OUT_DIM, generator=g)
    return TensorDataset(x, y)


def collate(samples: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*samples, strict=True)
    return torch.stack(xs), torch.stack(ys)


@torch.no_grad()
def eval_loss(model: torch.nn.Module, data: TensorDataset, device: torch.device,
              extra_s: float = 0.0) -> float:
    x, y = data.tensors
    model.eval()
    loss = torch.nn.functional.mse_loss(model(x.to(device)), y.to(device)).item()
    time.sleep(extra_s)
    model.train()
    return loss


def weights_sha256(model: torch.nn.Module) -> str | None:
    """Hash of the full (unsharded) weights; collective; the digest on rank 0, None elsewhere."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    h = hashlib.sha256()
    for key in sorted(sd):
        h.update(key.encode())
        h.update(sd[key].detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item()) / dist.get_world_size()


def mean_over_slots(total: float, count: int) -> float:
    """The mean over every micro-batch of a global batch, from each rank's sum over its own
    (``count`` of them): on the full world, with one each, the mean over ranks."""
    t = torch.tensor([total, count], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0].item()) / float(t[1].item())


class BatchLog:
    """Per-rank log of what each step trained, so tests can check no batch is lost or doubled."""

    def __init__(self, directory: str | None, rank: int) -> None:
        # Which start of the script this is: the agent's attempt and torchrun's restart count.
        self.attempt = (f"{os.environ.get('TRAINWARDEN_ATTEMPT', '0')}."
                        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
        self.f = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.f = open(Path(directory) / f"rank{rank}.log", "a", buffering=1)  # noqa: SIM115

    def write(self, step: int, batch_index: int, lr: float) -> None:
        if self.f is not None:
            self.f.write(f"{self.attempt} {step} {batch_index} {lr!r}\n")


def write_summary(path: str | None, **fields: Any) -> None:
    if path and dist.get_rank() == 0:
        fields["written_at"] = time.time()
        tmp = f"{path}.tmp{os.getpid()}"
        Path(tmp).write_text(json.dumps(fields, indent=1))
        os.replace(tmp, path)

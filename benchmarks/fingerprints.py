"""Cost of the replicas' parameter fingerprints (silent data corruption), on the DDP example's
model and on a 1M-parameter one, under real torchrun with gloo.

Each worker trains the model with DDP and AdamW in interleaved blocks of ``--every`` steps
(A: plain; B: the same steps plus ``Fingerprints.maybe_check`` after each optimizer step, so
one check per block, as at the default interval), alternating A B, B A, ... so that drift of
the machine hits both alike.  It reports the median step time of the plain blocks, the median
time of one check (compute + the all_gather of one int64), the overhead that makes at the
interval (check / (every x step)), and the A/B difference of the blocks' medians.

    .venv/bin/python benchmarks/fingerprints.py [--nproc 2 --every 100 --blocks 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODELS = {"example": 128, "1M": 704}  # the MLP's hidden width (train_ddp.py's default: 128)


def build(hidden: int):  # type: ignore[no-untyped-def]
    import torch

    layers = 2 if hidden <= 128 else 3
    mods: list[torch.nn.Module] = [torch.nn.Linear(32, hidden), torch.nn.GELU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 8))


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainwarden.agent.worker import init_distributed
    from trainwarden.agent.worker.fingerprint import Fingerprints

    os.environ["TRAINWARDEN_PREFLIGHT"] = "0"
    torch.set_num_threads(1)
    info = init_distributed(timeout=120)
    out: dict[str, dict[str, float]] = {}
    for name, hidden in MODELS.items():
        torch.manual_seed(0)
        model = DDP(build(hidden))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fp = Fingerprints(model, every=args.every)
        x, y = torch.randn(32, 32), torch.randn(32, 8)
        n_params = sum(p.numel() for p in model.parameters())

        def block(check: bool, start: int, model: torch.nn.Module = model,
                  opt: torch.optim.Optimizer = opt, fp: Fingerprints = fp,
                  x: torch.Tensor = x, y: torch.Tensor = y
                  ) -> tuple[float, list[float], list[float]]:
            steps, checks = [], []
            dist.barrier()
            t_block = time.perf_counter()
            for s in range(start, start + args.every):
                t0 = time.perf_counter()
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                t1 = time.perf_counter()
                if check:
                    fp.maybe_check(s + 1)
                    if fp.due(s + 1):
                        checks.append(time.perf_counter() - t1)
                steps.append(time.perf_counter() - t0)
            return time.perf_counter() - t_block, steps, checks

        step = 0
        _, _, _ = block(False, step)  # warm-up
        step += args.every
        plain_blocks, fp_blocks, plain_steps, checks = [], [], [], []
        for i in range(args.blocks):
            for check in ((False, True) if i % 2 == 0 else (True, False)):
                total, steps, c = block(check, step)
                step += args.every
                (fp_blocks if check else plain_blocks).append(total)
                if not check:
                    plain_steps += steps
                checks += c
        assert fp.last is not None and fp.last.agree
        step_s = statistics.median(plain_steps)
        check_s = statistics.median(checks)
        out[name] = {
            "params": n_params, "step_ms": step_s * 1e3, "check_ms": check_s * 1e3,
            "overhead_pct": 100 * check_s / (args.every * step_s),
            "ab_pct": 100 * (statistics.median(fp_blocks) / statistics.median(plain_blocks) - 1),
        }
    if info.rank == 0:
        Path(args.out).write_text(json.dumps(out))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2, help="ranks (replicas)")
    ap.add_argument("--every", type=int, default=None,
                    help="steps between checks (default: the library's default)")
    ap.add_argument("--blocks", type=int, default=10, help="A/B pairs of blocks per model")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.every is None:
        from trainwarden.agent.worker.fingerprint import DEFAULT_EVERY

        args.every = DEFAULT_EVERY
    if args.worker:
        worker(args)
        return
    import tempfile

    out = Path(tempfile.mkdtemp()) / "fingerprints.json"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINWARDEN_")}
    subprocess.run([torchrun, f"--nproc_per_node={args.nproc}", "--standalone", __file__,
                    "--worker", "--out", str(out), "--every", str(args.every), "--blocks",
                    str(args.blocks)], check=True, env={**env, "OMP_NUM_THREADS": "1"})
    res = json.loads(out.read_text())
    print(f"{args.nproc} ranks, a check every {args.every} steps, {args.blocks} A/B pairs")
    print("| model | parameters | step (median) | one check (median) | overhead at the "
          "interval | A/B blocks |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        print(f"| {name} | {int(r['params']):,} | {r['step_ms']:.2f} ms | {r['check_ms']:.2f} ms"
              f" | {r['overhead_pct']:.3f}% | {r['ab_pct']:+.2f}% |")


if __name__ == "__main__":
    main()

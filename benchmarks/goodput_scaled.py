"""Goodput at scale (``benchmarks/goodput.py --scaled``): weeks of a large run under
published failure rates, accounted by trainwarden's own ETTR accumulator.

What comes from where:

* Detection and restart times: measured on this machine by ``benchmarks/detection.py`` (real
  2-worker torchrun runs, default supervisor settings; benchmarks/results/*-detection.md, medians):
  crash 0.9 s to the incident, 6.2 s from the incident to the first resumed step; hang 25.3 s
  (the hang deadline's 25 s floor) and 6.7 s; loss spike 0.4 s and 5.2 s.  Where a detector's
  latency depends on the step time, its own rule scales it to the large run's step: a hang
  is called after max(floor, k x p99 step interval) (``HangConfig``), a loss spike after
  ``sustain_steps`` steps (``LossSpikeConfig``).  The restart times are this machine's (a
  2-worker CPU torchrun): a large job's rendezvous and multi-TB checkpoint load take longer,
  so a second table repeats the published-rate rows with an assumed 5-minute restart.
* Failure schedules: Meta's research clusters, 6.5 failures per 1,000 node-days (Kokolis et
  al. 2024); Llama 3 405B, 419 unexpected interruptions in 54 days on 16,384 GPUs (Dubey et
  al. 2024); and two stress schedules, one fault every 30 and every 5 minutes.  Faults are
  a Poisson process; the mix (80% crash, 17% hang, 3% loss spike) is an assumption: most of
  Llama 3's interruptions were hardware failures, which surface as a dying process, network
  and NCCL trouble as hangs, loss spikes are rare.
* The large run: 6 s per step (Llama 3 405B's 16M-token step at ~40% MFU on 16k H100s),
  8 GPUs per node, a checkpoint every 30 minutes as the current interval, against the
  interval ``trainwarden.supervisor.goodput.interval`` recommends for the schedule.
* Checkpoint cost, measured: trainwarden's ``Checkpointer(async_save=True)`` (DCP
  ``async_save`` on a group of its own) saving, on this machine, a model and AdamW state of
  one GPU's shard of a 405B model (405e9 parameters x 14 bytes: bf16 weights, fp32 master
  copy, two fp32 moments; / the GPUs) and a quarter of it: the ``stall_s`` each save reports
  (how long it held the training loop: the staging into host memory and the planning),
  fitted a + b x bytes and read at each scale's shard.  This machine stages from host
  memory; a GPU stages over PCIe (an assumption that it is no slower).  The background write
  is not this machine's disk: a node writes its 8 shards at an even share of Llama 3's
  storage, 2 TB/s sustained over 2,048 nodes (Dubey et al. 2024), and a checkpoint is usable
  only once written (``SimConfig.write_s``).  A second table keeps a 5 s stall per save
  (``--stall-s``; a save that blocks on more than its staging) for comparison.

Each row is ``trainwarden.supervisor.goodput.simulate`` feeding the event stream the supervisor
would
store (steps, checkpoints, incidents, restart decisions, resumes) to ``EttrAccumulator``;
"model" is Meta's expected-ETTR formula for the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trainwarden.supervisor.detect import HangConfig  # noqa: E402
from trainwarden.supervisor.detect.loss_spike import LossSpikeConfig  # noqa: E402
from trainwarden.supervisor.goodput import interval as iv  # noqa: E402
from trainwarden.supervisor.goodput.simulate import FaultKind, SimConfig, simulate  # noqa: E402

# Measured on this machine: benchmarks/results/*-detection.md (benchmarks/detection.py), medians.
MEASURED = {"crash": (0.9, 6.2), "hang": (25.3, 6.7), "loss_spike": (0.4, 5.2)}
MEASURED_STEP_S = 0.025  # the measured runs' step (2000 steps, ~50 s of step time)
MIX = {"crash": 0.80, "hang": 0.17, "loss_spike": 0.03}
GPUS_PER_NODE = 8
MODEL_PARAMS = 405e9  # Llama 3 405B
BYTES_PER_PARAM = 14  # bf16 weights (2) + fp32 master copy (4) + Adam's two fp32 moments (8)
NODE_WRITE_BPS = 2e12 / 2048  # Llama 3's storage, 2 TB/s sustained, shared by 2,048 nodes
PUBLISHED = [
    ("Llama 3 405B (Dubey et al. 2024)", "16,384 GPUs, 54 days, 419 interruptions",
     "> 90% effective training time"),
    ("ByteRobust (ByteDance 2025)", "production LLM training", "97% ETTR"),
    ("Gemini (Google)", "in-memory replicas", "goodput 85% -> 97%"),
]


@dataclass(frozen=True)
class Scenario:
    gpus: int
    schedule: str
    mtbf_s: float
    published: str = ""


def scenarios() -> list[Scenario]:
    out = []
    for gpus in (1024, 4096, 16384):
        nodes = gpus // GPUS_PER_NODE
        out.append(Scenario(gpus, "Meta 6.5/1000 node-days",
                            iv.DAY_S / (nodes * iv.META_RSC_PER_NODE_DAY)))
    out.append(Scenario(16384, "Llama 3 (419 in 54 days)",
                        iv.DAY_S / (2048 * iv.LLAMA3_PER_NODE_DAY), "Llama 3: > 90%"))
    out.append(Scenario(16384, "1 fault / 30 min", 1800.0, "goal >= 97%"))
    out.append(Scenario(16384, "1 fault / 5 min", 300.0, "goal >= 90%"))
    return out


def kinds(step_s: float, restart_s: float | None) -> tuple[FaultKind, ...]:
    hang, spike = HangConfig(), LossSpikeConfig()
    d_crash, r_crash = MEASURED["crash"]
    d_hang, r_hang = MEASURED["hang"]
    d_spike, r_spike = MEASURED["loss_spike"]
    # The detectors' own rules at the large run's step; the measured overhead on top.
    hang_s = max(hang.floor_s, hang.k * step_s) + (d_hang - hang.floor_s)
    spike_s = spike.sustain_steps * step_s + max(
        0.0, d_spike - spike.sustain_steps * MEASURED_STEP_S)
    return (FaultKind("crash", MIX["crash"], d_crash, restart_s or r_crash),
            FaultKind("hang", MIX["hang"], hang_s, restart_s or r_hang),
            FaultKind("loss_spike", MIX["loss_spike"], spike_s, restart_s or r_spike,
                      trains_until_detected=True))


def shard_bytes(gpus: int) -> float:
    """One GPU's share of the checkpoint (weights and optimizer state, fully sharded)."""
    return MODEL_PARAMS * BYTES_PER_PARAM / gpus


def write_seconds(gpus: int) -> float:
    """A node's background write of its GPUs' shards at its share of the storage."""
    return GPUS_PER_NODE * shard_bytes(gpus) / NODE_WRITE_BPS


@dataclass(frozen=True)
class SaveCost:
    """Measured staging stalls: (bytes, stall_s) per save, and the fit a + b x bytes."""

    samples: list[tuple[int, float]]
    a: float
    b: float
    write_bps: float  # this machine's background write, for comparison (not used)

    def stall_s(self, nbytes: float) -> float:
        return max(0.0, self.a + self.b * nbytes)


def measure_save_cost(saves: int = 4, target_bytes: float | None = None) -> SaveCost:
    """``Checkpointer(async_save=True)`` on this machine: models whose saved state is the
    16k-GPU shard and a quarter of it, ``saves`` saves each (the first, which builds DCP's
    plan and the staging buffers, left out); a real one-rank gloo group."""
    import shutil
    import statistics
    import tempfile

    import torch
    import torch.distributed as dist

    from trainwarden.agent.worker import Checkpointer
    from trainwarden.agent.worker.report import Reporter

    class Recording(Reporter):
        def __init__(self) -> None:
            super().__init__("")
            self.reports: list[dict[str, object]] = []

        def checkpoint(self, **kw: object) -> bool:  # type: ignore[override]
            self.reports.append(kw)
            return True

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    target = target_bytes if target_bytes is not None else shard_bytes(16384)
    samples: list[tuple[int, float]] = []
    writes: list[float] = []
    for frac in (0.25, 1.0):
        params = int(target * frac / 12)  # fp32 weights + AdamW's two moments: 12 bytes
        model = torch.nn.Linear(1024, max(1, params // 1024), bias=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()
        rep = Recording()
        root = tempfile.mkdtemp(prefix="tw-save-cost-")
        try:
            ck = Checkpointer(root, model, opt, async_save=True, reporter=rep, keep=1,
                              retention_grace_s=0.0)
            for step in range(1, saves + 1):
                ck.save(step)
                ck.wait()
        finally:
            shutil.rmtree(root, ignore_errors=True)
        for r in rep.reports[1:]:
            nbytes = int(r["nbytes"])  # type: ignore[call-overload]
            stall, save = float(r["stall_s"]), float(r["save_s"])  # type: ignore[arg-type]
            samples.append((nbytes, stall))
            writes.append(nbytes / max(1e-9, save - stall))
        del model, opt
    xs, ys = [float(x) for x, _ in samples], [y for _, y in samples]
    b, a = statistics.linear_regression(xs, ys)
    return SaveCost(samples=samples, a=a, b=b, write_bps=statistics.median(writes))


@dataclass
class Row:
    gpus: int
    schedule: str
    faults_per_day: float
    mtbf_s: float
    interval: str
    interval_s: float
    faults: int
    ettr: float | None
    model: float
    lost: float
    detection: float
    restart: float
    checkpoint: float
    published: str
    seconds: float


def run_row(sc: Scenario, *, label: str, interval_s: float, step_s: float, stall_s: float,
            restart_s: float | None, days: float, seed: int, write_s: float = 0.0) -> Row:
    cfg = SimConfig(mtbf_s=sc.mtbf_s, days=days, step_s=step_s, interval_s=interval_s,
                    stall_s=stall_s, kinds=kinds(step_s, restart_s), startup_s=0.0, seed=seed,
                    write_s=write_s)
    t0 = time.monotonic()
    r = simulate(cfg)
    b = r.breakdown
    # (Meta's model knows no background write: a checkpoint usable write_s later loses
    # write_s more per fault, so it is added to the restart overhead)
    model = max(0.0, iv.expected_ettr(nodes=1, rate_per_node_s=1 / sc.mtbf_s,
                                      restart_s=cfg.restart_overhead_s + write_s,
                                      interval_s=interval_s, save_stall_s=stall_s))
    return Row(sc.gpus, sc.schedule, iv.DAY_S / sc.mtbf_s, sc.mtbf_s, label, interval_s,
               sum(r.faults.values()), b.ettr, model, b.lost / b.wall_s,
               b.detection / b.wall_s, b.restart / b.wall_s, b.checkpoint / b.wall_s,
               sc.published, time.monotonic() - t0)


def recommended(sc: Scenario, *, step_s: float, stall_s: float, restart_s: float | None,
                write_s: float = 0.0) -> float:
    """The optimal interval for the stall, never shorter than a step or than the background
    write (a save due before the last is written waits for it)."""
    u0 = sum(k.share * (k.detect_s + k.restart_s) for k in kinds(step_s, restart_s))
    dt = iv.optimal_interval(mtbf_s=sc.mtbf_s, restart_s=u0 + write_s, save_stall_s=stall_s)
    return max(step_s, write_s, dt if dt is not None else step_s)


def _dur(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(rows: list[Row]) -> list[str]:
    lines = ["| GPUs | failure schedule | faults/day | interval | faults simulated | ETTR "
             "(accumulator) | ETTR (Meta model) | lost | detection | restart | checkpoint "
             "| published / goal |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.gpus:,} | {r.schedule} | {r.faults_per_day:.1f} | {r.interval} "
                     f"{_dur(r.interval_s)} | {r.faults} | {_pct(r.ettr)} | {_pct(r.model)} | "
                     f"{_pct(r.lost)} | {_pct(r.detection)} | {_pct(r.restart)} | "
                     f"{_pct(r.checkpoint)} | {r.published} |")
    return lines


def add_arguments(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("--scaled")
    g.add_argument("--days", type=float, default=54.0,
                   help="simulated run time (default 54, Llama 3's)")
    g.add_argument("--step-s", type=float, default=6.0, help="the large run's step (6 s)")
    g.add_argument("--stall-s", type=float, default=5.0,
                   help="the comparison table's training stall per save (5 s)")
    g.add_argument("--current-interval-s", type=float, default=1800.0)
    g.add_argument("--seed", type=int, default=1)


def main(args: argparse.Namespace, command: str) -> None:
    print(f"# command: {command}\n# {args.days:g} simulated days per row, step {args.step_s:g}"
          f" s, fault mix {MIX}; {os.cpu_count()} CPUs", flush=True)
    t0 = time.monotonic()
    cost = measure_save_cost()
    print("  save cost measured: " + ", ".join(f"{n / 1e6:.0f} MB {st:.3f} s"
                                               for n, st in cost.samples), flush=True)
    step = args.step_s

    def async_row(sc: Scenario, label: str, interval: float | None,
                  restart_s: float | None = None) -> Row:
        stall, write = cost.stall_s(shard_bytes(sc.gpus)), write_seconds(sc.gpus)
        dt = interval if interval is not None else recommended(
            sc, step_s=step, stall_s=stall, restart_s=restart_s, write_s=write)
        return run_row(sc, label=label, interval_s=dt, step_s=step, stall_s=stall,
                       restart_s=restart_s, days=args.days, seed=args.seed, write_s=write)

    rows: list[Row] = []
    for sc in scenarios():
        for label, dt in (("current", args.current_interval_s), ("recommended", None)):
            rows.append(async_row(sc, label, dt))
            print(f"  {sc.gpus} GPUs, {sc.schedule}, {label} {_dur(rows[-1].interval_s)}: "
                  f"{_pct(rows[-1].ettr)} ({rows[-1].seconds:.1f} s)", flush=True)
    slow = [async_row(sc, "recommended", None, restart_s=300.0) for sc in scenarios()[:4]]
    blocking: list[Row] = []  # a save that holds the loop for --stall-s
    for sc in scenarios():
        rec = recommended(sc, step_s=step, stall_s=args.stall_s, restart_s=None)
        blocking.append(run_row(sc, label="recommended", interval_s=rec, step_s=step,
                                stall_s=args.stall_s, restart_s=None, days=args.days,
                                seed=args.seed))
    elapsed = time.monotonic() - t0
    u0 = sum(k.share * (k.detect_s + k.restart_s) for k in kinds(step, None))
    shards = ", ".join(f"{g:,} GPUs {shard_bytes(g) / 1e6:,.0f} MB -> stall "
                       f"{cost.stall_s(shard_bytes(g)):.2f} s, node write "
                       f"{write_seconds(g):.1f} s" for g in (1024, 4096, 16384))
    out = [f"## Goodput at scale ({args.days:g} simulated days per row)", "",
           f"Command: `{command}`", "",
           "Detection and restart measured on this machine (scaled by the detectors' rules to "
           f"a {step:g} s step): "
           + ", ".join(f"{k.name} {k.detect_s:.1f} s + {k.restart_s:.1f} s"
                       for k in kinds(step, None))
           + f"; mean fault-to-training {u0:.1f} s.", "",
           "Save cost measured on this machine (`Checkpointer(async_save=True)`, the stall "
           "each save reported): "
           + ", ".join(f"{n / 1e6:.0f} MB {st:.3f} s" for n, st in cost.samples)
           + f"; fit {cost.a:.3f} s + {cost.b * 1e9:.3f} s/GB (this machine's background "
           f"write: {cost.write_bps / 1e6:.0f} MB/s, not used). Per scale: {shards}.", "",
           "Asynchronous saves at the measured stall:", "", *table(rows), "",
           "Same, at the recommended interval with an assumed 5-minute restart (a large "
           "job's rendezvous and checkpoint load; not measured here):", "", *table(slow), "",
           f"A save that holds the training loop {args.stall_s:g} s (`--stall-s`), at its "
           "recommended interval:", "", *table(blocking), "",
           "| published | scale | figure |", "|---|---|---|"]
    out += [f"| {a} | {b} | {c} |" for a, b, c in PUBLISHED]
    gains = [(a, b) for a, b in zip(rows[::2], rows[1::2], strict=True)]
    out += ["", "Recommended against current interval (ETTR points): "
            + "; ".join(f"{a.gpus:,} {a.schedule}: {_pct((b.ettr or 0) - (a.ettr or 0))}"
                        for a, b in gains) + ".",
            f"Measured and simulated in {elapsed:.0f} s."]
    print()
    print("\n".join(out))
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"command": command, "save_cost": asdict(cost),
             "rows": [asdict(r) for r in rows], "slow_restart": [asdict(r) for r in slow],
             "blocking_save": [asdict(r) for r in blocking],
             "kinds": [asdict(k) for k in kinds(step, None)]}, indent=1, default=str))

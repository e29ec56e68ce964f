"""Capacity planner (``trainwarden plan``): memory, sync time, MFU and reliability of a
training job from its model size, devices, precision and interconnect.  Standard library
only: it runs where only the agent is installed.

Units: memory (model states, activations, a device's size) in GiB, 2^30 bytes, as
``nvidia-smi`` and the allocator count it; a device's size is read in GiB, as its label says
(an "80 GB" H100 is 80 GiB; nvidia-smi shows 81,559 MiB, 79.6 GiB, the rest within the
reserve).  Links and storage in GB/s, 10^9 bytes, as their vendors rate them, and so the
checkpoint's size in GB (it divides by a write rate).  The ZeRO paper's figures are in GB
(10^9): 7.5B x 16 bytes is its 120 GB, 111.8 GiB here.

Sources and formulas:

* **Bytes per parameter** (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward
  Training Trillion Parameter Models", section 3.1): mixed precision with Adam keeps 16-bit
  weights (2) and gradients (2) and K = 12 bytes of optimizer state (fp32 master weights 4,
  momentum 4, variance 4): 16 bytes per parameter.  fp32 training: 4 + 4 + 8 = 16 (no
  separate master).  ``bf16-pure`` (no fp32 master, 16-bit moments): 2 + 2 + 4 = 8.
* **Memory per device** for N data-parallel devices (ZeRO paper, Figure 1): DDP keeps
  everything on every device; ZeRO-1 shards the optimizer state (master + moments) / N;
  ZeRO-2 also the gradients; ZeRO-3 (FSDP full sharding) also the weights.  FSDP's
  ``SHARD_GRAD_OP`` is ZeRO-2, ``FULL_SHARD`` is ZeRO-3.
* **Activations** per transformer layer and micro-batch (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", arXiv 2205.05198, section 4, no
  tensor or sequence parallelism, 16-bit activations): ``s*b*h*(34 + 5*a*s/h)`` bytes, for
  sequence length s, micro-batch b, hidden size h, a heads.  Selective recomputation (and
  FlashAttention, which never stores the s x s attention scores) drops the ``5as/h`` term:
  ``34*s*b*h``.  Full recomputation (activation checkpointing of every layer) keeps only each
  layer's input, ``2*s*b*h``, plus one layer's activations while it is recomputed in the
  backward pass.  Added outside the per-layer formula: the output logits kept in fp32 for the
  loss, ``4*s*b*v``.
* **Parameters from a shape** (Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", section 5.1):
  ``12*L*h^2 * (1 + 13/(12h) + (V + s)/(12*L*h))``.
* **Model FLOPs per token**: ``6*P + 12*L*h*s`` (forward and backward of the weights, and of
  attention; Chowdhery et al. 2022, PaLM, appendix B).  MFU counts these, not recomputation.
* **Gradient sync per step**: ring all-reduce moves ``2(N-1)/N x bytes`` through each
  device's link (DDP, ZeRO-1 and ZeRO-2 reduce the gradients once); ZeRO-3 moves
  ``3(N-1)/N x bytes`` (reduce-scatter of the gradients, all-gather of the weights in the
  forward and again in the backward: 1.5x DDP, ZeRO paper section 7).  Bandwidths are the
  nominal per-device, per-direction link rates in ``INTERCONNECTS``; NCCL typically
  reaches 70-90% of them, and a NIC shared by several GPUs gives each its share.
* **Step time and expected MFU**: compute = model FLOPs of a device's step / (peak x
  ``kernel_efficiency``), times 4/3 with full activation checkpointing (one more forward
  pass); the sync overlaps the backward pass (two thirds of the compute; all of it for
  ZeRO-3, whose gathers are prefetched) and only what exceeds it adds to the step.
  Expected MFU = model FLOPs / (step time x peak).  ``kernel_efficiency`` 0.45 is an
  assumption: what dense matmuls sustain when nothing else stalls them (Llama 3 reports
  38-43% MFU at 16k GPUs).
* **Reliability**: failures per day = nodes x a published rate (Meta's research clusters,
  6.5 per 1,000 node-days, Kokolis et al. 2024; Llama 3, 419 interruptions in 54 days on
  2,048 nodes, ~3.8 per 1,000 node-days); ETTR at a checkpoint interval and the recommended
  interval from ``interval`` (Meta's expected-ETTR model).  The save stall, unless given, is
  a synchronous save: the checkpoint (fp32 weights and optimizer state) / (nodes x write
  bandwidth per node).

Not modelled: tensor and pipeline parallelism, temporary buffers (DDP's gradient buckets,
ZeRO-3's gathered layer), the CUDA context and allocator fragmentation: ``memory_reserve``
(10% of the device by default) is held back for them when judging what fits.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from trainwarden.supervisor.goodput import interval as iv
from trainwarden.supervisor.goodput.mfu import band

GB = 1e9  # links, storage, the checkpoint's size
GIB = float(2**30)  # memory
STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
ACTIVATION_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Precision:
    weights: int  # bytes per parameter
    grads: int
    master: int  # fp32 master copy (0: none)
    description: str


PRECISIONS = {
    "fp32": Precision(4, 4, 0, "fp32 weights and gradients (TF32 matmuls)"),
    "bf16": Precision(2, 2, 4, "bf16 mixed precision with fp32 master weights"),
    "fp16": Precision(2, 2, 4, "fp16 mixed precision with fp32 master weights"),
    "bf16-pure": Precision(2, 2, 0, "bf16 weights, no fp32 master (bf16 optimizer state)"),
}
# Optimizer state bytes per parameter: fp32 moments; the pure-bf16 recipe keeps them in bf16.
OPTIMIZERS = {"adam": 8, "sgd-momentum": 4, "sgd": 0}


@dataclass(frozen=True)
class Interconnect:
    bytes_per_s: float  # per device, one direction, nominal
    description: str


INTERCONNECTS = {
    "nvlink": Interconnect(450e9, "NVLink 4 (H100 SXM): 450 GB/s per direction"),
    "pcie": Interconnect(32e9, "PCIe 4.0 x16: 32 GB/s per direction"),
    "ib400": Interconnect(50e9, "400 Gb/s InfiniBand NDR, one NIC per GPU: 50 GB/s"),
    "100gbe": Interconnect(12.5e9, "100 Gb Ethernet: 12.5 GB/s"),
    "10gbe": Interconnect(1.25e9, "10 Gb Ethernet: 1.25 GB/s"),
}


@dataclass(frozen=True)
class Device:
    memory_gib: float  # as the label says: an "80 GB" card is 80 GiB
    peak_tflops_16: float  # dense bf16/fp16 tensor cores
    peak_tflops_32: float  # dense TF32 tensor cores
    description: str


DEVICES = {
    "a100-40": Device(40, 312, 156, "NVIDIA A100 40 GB (SXM)"),
    "a100-80": Device(80, 312, 156, "NVIDIA A100 80 GB (SXM)"),
    "h100": Device(80, 989, 494, "NVIDIA H100 80 GB (SXM)"),
    "h200": Device(141, 989, 494, "NVIDIA H200 141 GB (SXM)"),
}

FAILURE_RATES = {  # per node-day
    "meta": iv.META_RSC_PER_NODE_DAY,
    "llama3": iv.LLAMA3_PER_NODE_DAY,
}


def parse_count(text: str) -> float:
    """``7e9``, ``7B``, ``1.3b``, ``125M``, ``70_000_000`` -> a number of parameters."""
    m = re.fullmatch(r"\s*([0-9][0-9_]*\.?[0-9]*(?:e[0-9]+)?)\s*([kmbt]?)\s*", text, re.I)
    if not m:
        raise ValueError(f"not a parameter count: {text!r} (try 7e9 or 7B)")
    scale = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[m.group(2).lower()]
    return float(m.group(1).replace("_", "")) * scale


@dataclass(frozen=True)
class PlanInputs:
    """What the plan is computed from (each default written once, here)."""

    params: float | None = None  # parameters; or derived from the shape
    layers: int | None = None
    hidden: int | None = None
    heads: int | None = None
    seq_len: int | None = None
    vocab: int | None = None
    micro_batch: int = 1  # sequences per device per forward/backward
    grad_accum: int = 1  # micro-batches per optimizer step
    devices: int = 8
    devices_per_node: int = 8
    gpu: str = "h100"
    device_memory_gib: float | None = None  # default: the gpu's
    peak_tflops: float | None = None  # default: the gpu's, for the precision
    precision: str = "bf16"
    optimizer: str = "adam"
    interconnect: str = "nvlink"
    # none: standard attention, nothing recomputed; selective: FlashAttention or selective
    # recomputation (the s x s scores never stored), what current training stacks do; full:
    # every layer recomputed in the backward pass.
    activation_checkpointing: str = "selective"
    strategy: str | None = None  # default: the least sharded one that fits
    kernel_efficiency: float = 0.45
    memory_reserve: float = 0.10
    failure_rate: str | float = "meta"  # a name of FAILURE_RATES or failures per node-day
    restart_s: float = 300.0  # fault to training again
    checkpoint_interval_s: float = 1800.0
    checkpoint_write_gb_per_s: float = 2.0  # per node, to the checkpoint storage
    checkpoint_stall_s: float | None = None  # default: a synchronous save's

    def __post_init__(self) -> None:
        shape = (self.layers, self.hidden)
        if self.params is None and None in shape:
            raise ValueError("plan needs --params, or the shape --layers and --hidden (with "
                             "--vocab and --seq-len for the embeddings)")
        if self.params is not None and not (math.isfinite(self.params) and self.params > 0):
            raise ValueError(f"params must be > 0, got {self.params}")
        for name in ("layers", "hidden", "heads", "seq_len", "vocab"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.heads and self.hidden and self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be a multiple of heads "
                             f"({self.heads})")
        for name in ("micro_batch", "grad_accum", "devices", "devices_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        choices: dict[str, Collection[str]] = {
            "gpu": DEVICES, "precision": PRECISIONS, "optimizer": OPTIMIZERS,
            "interconnect": INTERCONNECTS}
        for name, table in choices.items():
            if getattr(self, name) not in table:
                raise ValueError(f"{name} must be one of {', '.join(table)}, got "
                                 f"{getattr(self, name)!r}")
        if self.activation_checkpointing not in ACTIVATION_MODES:
            raise ValueError("activation_checkpointing must be one of "
                             f"{', '.join(ACTIVATION_MODES)}")
        if self.strategy is not None and self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}")
        if not 0 < self.kernel_efficiency <= 1:
            raise ValueError("kernel_efficiency must be in (0, 1], e.g. 0.45")
        if not 0 <= self.memory_reserve < 1:
            raise ValueError("memory_reserve must be in [0, 1), e.g. 0.1")
        if isinstance(self.failure_rate, str):
            if self.failure_rate not in FAILURE_RATES:
                raise ValueError(f"failure_rate must be one of {', '.join(FAILURE_RATES)} or "
                                 "a number of failures per node-day")
        elif not self.failure_rate >= 0:
            raise ValueError("failure_rate must be >= 0 failures per node-day")
        for name in ("restart_s", "checkpoint_interval_s", "checkpoint_write_gb_per_s",
                     "device_memory_gib", "peak_tflops", "checkpoint_stall_s"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if not self.checkpoint_interval_s > 0:
            raise ValueError("checkpoint_interval_s must be > 0")


# --------------------------------------------------------------------------------------------
# The pieces (each a small pure function, tested on its own)


def params_from_shape(*, layers: int, hidden: int, vocab: int = 0, seq_len: int = 0) -> float:
    """Narayanan et al. 2021: 12 L h^2 (1 + 13/(12h) + (V + s)/(12 L h))."""
    h, L = float(hidden), float(layers)
    return 12 * L * h * h * (1 + 13 / (12 * h) + (vocab + seq_len) / (12 * L * h))


def bytes_per_param(precision: str, optimizer: str) -> dict[str, int]:
    p = PRECISIONS[precision]
    opt = OPTIMIZERS[optimizer]
    if precision == "bf16-pure":
        opt //= 2  # moments in bf16
    return {"weights": p.weights, "grads": p.grads, "master": p.master, "optimizer": opt,
            "total": p.weights + p.grads + p.master + opt}


def state_bytes_per_device(params: float, bpp: dict[str, int], devices: int,
                           strategy: str) -> float:
    """ZeRO paper, Figure 1: model states per device."""
    w, g, o = bpp["weights"], bpp["grads"], bpp["master"] + bpp["optimizer"]
    n = devices
    per = {"ddp": w + g + o, "zero1": w + g + o / n, "zero2": w + (g + o) / n,
           "zero3": (w + g + o) / n}[strategy]
    return params * per


def activation_bytes_per_layer(*, seq_len: int, micro_batch: int, hidden: int, heads: int,
                               mode: str) -> float:
    """Korthikanti et al. 2022, per layer, 16-bit, no tensor/sequence parallelism."""
    s, b, h, a = seq_len, micro_batch, hidden, heads
    if mode == "none":
        return s * b * h * (34 + 5 * a * s / h)
    if mode == "selective":
        return 34.0 * s * b * h
    return 2.0 * s * b * h  # full: the layer input only


def activation_bytes(*, layers: int, seq_len: int, micro_batch: int, hidden: int, heads: int,
                     vocab: int | None, mode: str) -> float:
    """All layers' activations per device, the recomputed layer's working set (full
    checkpointing) and the fp32 logits."""
    kw = {"seq_len": seq_len, "micro_batch": micro_batch, "hidden": hidden, "heads": heads}
    total = layers * activation_bytes_per_layer(mode=mode, **kw)
    if mode == "full":  # one layer recomputed at a time, FlashAttention-style
        total += activation_bytes_per_layer(mode="selective", **kw)
    if vocab:
        total += 4.0 * seq_len * micro_batch * vocab
    return total


def ring_allreduce_s(nbytes: float, devices: int, bytes_per_s: float) -> float:
    """2(N-1)/N x bytes / bandwidth (0 on one device)."""
    return 2.0 * (devices - 1) / devices * nbytes / bytes_per_s if devices > 1 else 0.0


def sync_s(grad_bytes: float, devices: int, bytes_per_s: float, strategy: str) -> float:
    """Gradient sync per optimizer step: an all-reduce (DDP, ZeRO-1/2) or ZeRO-3's 1.5x."""
    base = ring_allreduce_s(grad_bytes, devices, bytes_per_s)
    return base * 1.5 if strategy == "zero3" else base


# --------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class MemoryRow:
    """One strategy's memory per device, in GiB."""

    strategy: str
    states_gib: float
    activations_gib: float | None  # at the chosen activation checkpointing
    total_gib: float
    fits: bool


@dataclass(frozen=True)
class SyncRow:
    interconnect: str
    gb_per_s: float
    sync_s: float  # for the chosen strategy
    exposed_s: float | None  # what the step waits for beyond the overlap
    share_of_step: float | None
    chosen: bool


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    params: float
    flops_per_token: float
    tokens_per_step: float | None  # global
    bytes_per_param: dict[str, int]
    device_memory_gib: float
    usable_memory_gib: float
    peak_flops: float
    activations_gib: dict[str, float] | None  # per mode, per device
    memory: tuple[MemoryRow, ...]
    strategy: str
    strategy_fits: bool
    sync: tuple[SyncRow, ...]
    compute_s: float | None
    step_s: float | None
    mfu: float | None
    mfu_band: str | None
    nodes: int
    failures_per_day: float
    checkpoint_gb: float
    checkpoint_stall_s: float
    advice: iv.Advice
    notes: tuple[str, ...] = field(default=())

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["inputs"] = asdict(self.inputs)
        d["advice"] = self.advice.as_dict()
        d["advice"].pop("inputs")
        d["assumptions"] = {
            "interconnect_gb_per_s": {k: v.bytes_per_s / GB for k, v in INTERCONNECTS.items()},
            "kernel_efficiency": self.inputs.kernel_efficiency,
            "memory_reserve": self.inputs.memory_reserve,
            "failure_rate_per_node_day": self.advice.rate_per_node_day,
        }
        return d


def _failure_rate(inp: PlanInputs) -> float:
    fr = inp.failure_rate
    return FAILURE_RATES[fr] if isinstance(fr, str) else float(fr)


def make_plan(inp: PlanInputs) -> Plan:
    notes: list[str] = []
    dev = DEVICES[inp.gpu]
    mem_gib = inp.device_memory_gib if inp.device_memory_gib is not None else dev.memory_gib
    sixteen = inp.precision != "fp32"
    tflops = inp.peak_tflops if inp.peak_tflops is not None else (
        dev.peak_tflops_16 if sixteen else dev.peak_tflops_32)
    peak = tflops * 1e12
    shape = inp.layers is not None and inp.hidden is not None
    if inp.params is not None:
        params = inp.params
    else:
        assert inp.layers is not None and inp.hidden is not None
        params = params_from_shape(layers=inp.layers, hidden=inp.hidden, vocab=inp.vocab or 0,
                                   seq_len=inp.seq_len or 0)
    fpt = 6.0 * params
    if shape and inp.seq_len:
        assert inp.layers is not None and inp.hidden is not None
        fpt += 12.0 * inp.layers * inp.hidden * inp.seq_len
    tokens_dev = (inp.micro_batch * inp.grad_accum * inp.seq_len) if inp.seq_len else None
    bpp = bytes_per_param(inp.precision, inp.optimizer)

    acts: dict[str, float] | None = None
    if shape and inp.heads and inp.seq_len:
        assert inp.layers is not None and inp.hidden is not None
        acts = {m: activation_bytes(layers=inp.layers, seq_len=inp.seq_len,
                                    micro_batch=inp.micro_batch, hidden=inp.hidden,
                                    heads=inp.heads, vocab=inp.vocab, mode=m) / GIB
                for m in ACTIVATION_MODES}
    else:
        notes.append("activation memory needs the shape (--layers --hidden --heads --seq-len):"
                     " not counted")
    act_gib = acts[inp.activation_checkpointing] if acts else None
    usable = mem_gib * (1 - inp.memory_reserve)
    rows = []
    for s in STRATEGIES:
        states = state_bytes_per_device(params, bpp, inp.devices, s) / GIB
        total = states + (act_gib or 0.0)
        rows.append(MemoryRow(s, states, act_gib, total, total <= usable))
    if inp.strategy is not None:
        strategy = inp.strategy
    else:
        strategy = next((r.strategy for r in rows if r.fits), "zero3")
    fits = next(r.fits for r in rows if r.strategy == strategy)
    if not fits:
        notes.append(f"{strategy} does not fit in {usable:.1f} GiB usable per device: more "
                     "devices, activation checkpointing or a smaller micro-batch")

    grad_bytes = params * bpp["grads"]
    compute = None
    if tokens_dev is not None:
        compute = tokens_dev * fpt / (peak * inp.kernel_efficiency)
        if inp.activation_checkpointing == "full":
            compute *= 4.0 / 3.0
    overlap = None if compute is None else (compute if strategy == "zero3" else compute * 2 / 3)
    sync_rows = []
    step = None
    for name, ic in INTERCONNECTS.items():
        t = sync_s(grad_bytes, inp.devices, ic.bytes_per_s, strategy)
        exposed = None if overlap is None else max(0.0, t - overlap)
        st = None if compute is None or exposed is None else compute + exposed
        if name == inp.interconnect:
            step = st
        sync_rows.append(SyncRow(name, ic.bytes_per_s / GB, t, exposed,
                                 (exposed / st) if st and exposed is not None else None,
                                 name == inp.interconnect))
    mfu = (tokens_dev * fpt / peak / step) if step and tokens_dev else None
    chosen = next(r for r in sync_rows if r.chosen)
    if chosen.share_of_step is not None and chosen.share_of_step > 0.10:
        notes.append(f"the expected MFU is held down by the gradient sync on "
                     f"{inp.interconnect}: {chosen.share_of_step:.0%} of the step waits for it")
    if tokens_dev is None:
        notes.append("step time and MFU need --seq-len (tokens per step)")

    nodes = math.ceil(inp.devices / inp.devices_per_node)
    rate = _failure_rate(inp)
    ckpt_gb = params * (max(bpp["weights"], bpp["master"]) + bpp["optimizer"]) / GB
    stall = (inp.checkpoint_stall_s if inp.checkpoint_stall_s is not None
             else ckpt_gb / (nodes * inp.checkpoint_write_gb_per_s))
    advice = iv.advise(iv.IntervalInputs(
        nodes=nodes, failures=0, observed_s=0.0, save_stall_s=stall, restart_s=inp.restart_s,
        interval_s=inp.checkpoint_interval_s,
        prior_per_node_day=rate if rate > 0 else None))
    return Plan(inputs=inp, params=params, flops_per_token=fpt,
                tokens_per_step=tokens_dev * inp.devices if tokens_dev else None,
                bytes_per_param=bpp, device_memory_gib=mem_gib, usable_memory_gib=usable,
                peak_flops=peak, activations_gib=acts, memory=tuple(rows), strategy=strategy,
                strategy_fits=fits, sync=tuple(sync_rows), compute_s=compute, step_s=step,
                mfu=mfu, mfu_band=band(mfu).name if mfu is not None else None, nodes=nodes,
                failures_per_day=nodes * rate, checkpoint_gb=ckpt_gb,
                checkpoint_stall_s=stall, advice=advice, notes=tuple(notes))


# --------------------------------------------------------------------------------------------
# Comparison with a live run (GET /api/v1/runs/{run})


@dataclass(frozen=True)
class CheckRow:
    quantity: str
    planned: float | None
    measured: float | None
    note: str

    @property
    def ratio(self) -> float | None:
        if self.planned and self.measured is not None:
            return self.measured / self.planned
        return None


def compare(plan: Plan, run: dict[str, Any]) -> tuple[CheckRow, ...]:
    """The plan against what ``GET /api/v1/runs/{run}`` reports today: step time from
    ``throughput.steps_per_s`` (newest steps), MFU (the run's ``mfu`` where the response has
    one, else its tokens/s (or samples/s x --seq-len) x the plan's FLOPs per token / (ranks x
    the plan's peak)), the largest memory in use on any device in the agents' latest NVML
    reading, and the number of ranks."""
    tp = run.get("throughput") or {}
    sps = tp.get("steps_per_s")
    ranks = tp.get("ranks")
    rows = [CheckRow("step time s", plan.step_s, 1.0 / sps if sps else None,
                     "1 / steps per second over the newest steps every rank delivered")]
    mfu = run.get("mfu")
    if isinstance(mfu, dict):  # the run's MFU diagnosis (``mfu.mfu`` is its MFU)
        mfu = mfu.get("mfu")
    how = "the run's MFU (declared FLOPs)"
    if mfu is None and isinstance(ranks, int) and ranks > 0:
        tokens = tp.get("tokens_per_s")
        if not tokens and tp.get("samples_per_s") and plan.inputs.seq_len:
            tokens = tp["samples_per_s"] * plan.inputs.seq_len
        if tokens:
            mfu = tokens * plan.flops_per_token / (ranks * plan.peak_flops)
            how = "measured tokens/s x the plan's FLOPs per token / (ranks x peak)"
        else:
            how = "no tokens/s reported (report tokens=, or pass --seq-len)"
    rows.append(CheckRow("MFU", plan.mfu, mfu, how))
    used = [d.get("mem_used_bytes") for a in run.get("agents") or []
            for d in ((a.get("gpus") or {}).get("devices") or [])
            if isinstance(d.get("mem_used_bytes"), int | float)]
    planned = next(r.total_gib for r in plan.memory if r.strategy == plan.strategy)
    rows.append(CheckRow(f"memory per device GiB ({plan.strategy})", planned,
                         max(used) / GIB if used else None,
                         "largest mem_used of any GPU in the agents' latest NVML reading"
                         if used else "no NVML reading from the agents (no GPU or no driver)"))
    rows.append(CheckRow("ranks", float(plan.inputs.devices),
                         float(ranks) if isinstance(ranks, int) else None,
                         "ranks reporting the newest steps"))
    return tuple(rows)


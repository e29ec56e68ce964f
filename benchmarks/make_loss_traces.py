"""Generate the corpus of real loss traces in ``tests/data/loss_traces/``.

Each trace is a tiny model really trained on CPU (one process, one thread), step by step,
with or without a real corruption of its training: a range of corrupted batches, a burst of
a too-high learning rate, a learning rate that grows until the loss is NaN, a NaN batch, or a
permanent change of the data or the LR.  The loss (and gradient norm) of every step is
stored, with what was done to the run and the label its own curve gives
(``tests/loss_traces.py``: clean / transient / sustained / nan, decided from the losses alone,
not from what was injected).  The loss-spike detector's tests and ``benchmarks/
spike_detection.py`` replay these files.

    .venv/bin/python benchmarks/make_loss_traces.py            # all traces (about a minute)
    .venv/bin/python benchmarks/make_loss_traces.py --only mlp  # names containing "mlp"

Everything is seeded (data order, initial weights, corruption): the same torch version gives
the same files.  Models:

* ``mlp``: regression onto a fixed random teacher network (the examples' task), AdamW;
* ``cls``: a Gaussian-mixture classifier (MLP, cross-entropy), SGD with momentum;
* ``gru``: a character GRU language model on text from a seeded Markov chain, Adam;
* ``tfm``: a one-layer transformer language model on the same kind of text, AdamW with a
  linear warm-up and a cosine decay (the loss falls fast early on).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the corpus helpers live in the repository
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tests.loss_traces import CORPUS_DIR, encode, label_trace  # noqa: E402

STEPS = 400
VOCAB = 24
SEQ = 32


@dataclass(frozen=True)
class Corruption:
    """What is done to the run: ``kind`` from ``at`` for ``length`` steps (batches).

    ``data``: the batches' data is corrupted (``factor``: how strongly, where it applies);
    ``lr``: LR x ``factor``; ``lr_grow``: LR x ``factor`` ** (steps since ``at``), to the end;
    ``nan``: the input of batch ``at`` is NaN; ``length`` 0: to the end of the run."""

    kind: str
    at: int
    length: int = 1
    factor: float = 1.0

    def active(self, step: int) -> bool:
        return step >= self.at and (self.length == 0 or step < self.at + self.length)


@dataclass(frozen=True)
class Spec:
    name: str
    model: str
    seed: int
    corruption: Corruption | None = None
    batch_size: int | None = None  # the model's default when None


class Task:
    """A model, its optimiser and a deterministic stream of batches."""

    base_lr: float
    model: nn.Module
    opt: torch.optim.Optimizer

    def __init__(self, seed: int, batch_size: int | None) -> None:
        self.seed = seed
        self.gen = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def corrupt(self, x: torch.Tensor, y: torch.Tensor, factor: float, step: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def lr_at(self, step: int) -> float:
        return self.base_lr


class MLPTask(Task):
    base_lr = 2e-3

    def __init__(self, seed: int, batch_size: int | None) -> None:
        super().__init__(seed, batch_size)
        self.bs = batch_size or 32
        g = torch.Generator().manual_seed(10_000 + seed)
        self.teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        with torch.no_grad():
            for p in self.teacher.parameters():
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / fan_in**0.5))
        self.model = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(),
                                   nn.Linear(32, 8))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.base_lr)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.bs, 32, generator=self.gen)
        with torch.no_grad():
            y = self.teacher(x) + 0.05 * torch.randn(self.bs, 8, generator=self.gen)
        return x, y

    def corrupt(self, x: torch.Tensor, y: torch.Tensor, factor: float, step: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # As the examples' --inject spike: large, wrong targets.
        return x * factor, -y * factor + factor

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.model(x), y)


class ClsTask(Task):
    base_lr = 0.05

    def __init__(self, seed: int, batch_size: int | None) -> None:
        super().__init__(seed, batch_size)
        self.bs = batch_size or 32
        self.centers = torch.randn(10, 16, generator=self.gen) * 0.5  # overlapping classes
        self.model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=self.base_lr, momentum=0.9)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = torch.randint(0, 10, (self.bs,), generator=self.gen)
        x = self.centers[y] + torch.randn(self.bs, 16, generator=self.gen)
        return x, y

    def corrupt(self, x: torch.Tensor, y: torch.Tensor, factor: float, step: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # factor 1: random labels; above 1: inputs scaled up as well.
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        return x * factor, torch.randint(0, 10, y.shape, generator=g)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x), y)


class TextTask(Task):
    """Text from a seeded first-order Markov chain: each character has a few likely
    successors, so a model can learn it well below the uniform loss ln(VOCAB)."""

    def __init__(self, seed: int, batch_size: int | None) -> None:
        super().__init__(seed, batch_size)
        self.bs = batch_size or 16
        logits = torch.randn(VOCAB, VOCAB, generator=self.gen) * 3.0
        self.trans = torch.softmax(logits, dim=1)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        seqs = torch.empty(self.bs, SEQ + 1, dtype=torch.long)
        seqs[:, 0] = torch.randint(0, VOCAB, (self.bs,), generator=self.gen)
        for i in range(1, SEQ + 1):
            seqs[:, i] = torch.multinomial(self.trans[seqs[:, i - 1]], 1,
                                           generator=self.gen).squeeze(1)
        return seqs[:, :-1], seqs[:, 1:]

    def corrupt(self, x: torch.Tensor, y: torch.Tensor, factor: float, step: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        # Uniformly random characters (a corrupted shard); factor > 1: one repeated
        # character instead, which drags the model towards predicting it.
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        if factor > 1:
            c = int(torch.randint(0, VOCAB, (1,), generator=g))
            return torch.full_like(x, c), torch.full_like(y, c)
        r = torch.randint(0, VOCAB, (x.shape[0], x.shape[1] + 1), generator=g)
        return r[:, :-1], r[:, 1:]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))


class _GRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.rnn = nn.GRU(16, 64, batch_first=True)
        self.out = nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        out: torch.Tensor = self.out(h)
        return out


class GRUTask(TextTask):
    base_lr = 3e-3

    def __init__(self, seed: int, batch_size: int | None) -> None:
        super().__init__(seed, batch_size)
        self.model = _GRU()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=self.base_lr)


class _Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.pos = nn.Parameter(torch.randn(SEQ, 32) * 0.02)
        self.block = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True,
                                                norm_first=True)
        self.out = nn.Linear(32, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.emb(x) + self.pos, src_mask=self.mask, is_causal=True)
        out: torch.Tensor = self.out(h)
        return out


class TransformerTask(TextTask):
    base_lr = 3e-3
    warmup = 40

    def __init__(self, seed: int, batch_size: int | None) -> None:
        super().__init__(seed, batch_size)
        self.model = _Transformer()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.base_lr)

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.base_lr * (step + 1) / self.warmup
        frac = (step - self.warmup) / max(1, STEPS - self.warmup)
        return self.base_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


TASKS: dict[str, Callable[[int, int | None], Task]] = {
    "mlp": MLPTask, "cls": ClsTask, "gru": GRUTask, "tfm": TransformerTask}


def train(spec: Spec) -> dict[str, Any]:
    """Train one trace; returns its file's content."""
    torch.set_num_threads(1)
    task = TASKS[spec.model](spec.seed, spec.batch_size)
    c = spec.corruption
    losses: list[float | None] = []
    grads: list[float | None] = []
    for step in range(STEPS):
        x, y = task.batch(step)
        lr = task.lr_at(step)
        if c is not None and c.kind == "data" and c.active(step):
            x, y = task.corrupt(x, y, c.factor, step)
        if c is not None and c.kind == "nan" and step == c.at:
            x = torch.full_like(x, float("nan")) if x.is_floating_point() else x
            if not x.is_floating_point():  # token input: poison the weights' input instead
                with torch.no_grad():
                    next(task.model.parameters()).fill_(float("nan"))
        if c is not None and c.kind == "lr" and c.active(step):
            lr *= c.factor
        if c is not None and c.kind == "lr_grow" and step >= c.at:
            lr *= c.factor ** (step - c.at + 1)
        for g in task.opt.param_groups:
            g["lr"] = lr
        loss = task.loss(x, y)
        task.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(task.model.parameters(), float("inf"))
        task.opt.step()
        losses.append(_round(float(loss.item())))
        grads.append(_round(float(gn.item())))
    label = label_trace(losses, grads)
    return {"name": spec.name, "model": spec.model, "seed": spec.seed,
            "batch_size": spec.batch_size, "steps": STEPS,
            "corruption": asdict(c) if c is not None else None,
            "label": label.label, "label_details": asdict(label),
            "torch": torch.__version__,
            "loss": [encode(x) for x in losses], "grad_norm": [encode(x) for x in grads]}


def _round(x: float) -> float | None:
    """Four significant digits keep the files small; non-finite values stay as they are."""
    if not math.isfinite(x):
        return x
    return float(f"{x:.4g}")


def specs(seed_offset: int = 0) -> list[Spec]:
    """The corpus: every model clean, then each kind of corruption at several strengths.
    ``seed_offset`` shifts every seed (a held-out set made the same way)."""
    out: list[Spec] = []
    for model in TASKS:
        for seed in (0, 1, 2):
            out.append(Spec(f"{model}-clean-s{seed + seed_offset}", model, seed + seed_offset))
    for model in ("mlp", "cls"):  # noisy: small batches
        seed = 3 + seed_offset
        out.append(Spec(f"{model}-clean-bs8-s{seed}", model, seed, batch_size=8))

    def add(model: str, seed: int, c: Corruption, tag: str) -> None:
        seed += seed_offset
        out.append(Spec(f"{model}-{tag}-s{seed}", model, seed, c))

    # Corrupted batch ranges, short to long, mild to severe.
    for seed, (n, f) in enumerate([(1, 3.0), (3, 5.0), (3, 30.0), (10, 10.0), (20, 30.0),
                                   (5, 30.0), (5, 1.0), (15, 1.0), (2, 2.0), (40, 1.0)]):
        add("mlp", seed, Corruption("data", 200 + 10 * seed, n, f), f"data{n}x{f:g}")
    for seed, (n, f) in enumerate([(3, 1.0), (10, 1.0), (40, 1.0), (3, 10.0), (10, 30.0)]):
        add("cls", seed, Corruption("data", 180 + 10 * seed, n, f), f"data{n}x{f:g}")
    for seed, (n, f) in enumerate([(2, 1.0), (8, 1.0), (30, 1.0), (5, 2.0), (20, 2.0)]):
        add("gru", seed, Corruption("data", 190 + 10 * seed, n, f), f"data{n}x{f:g}")
    for seed, (n, f) in enumerate([(3, 1.0), (15, 1.0), (6, 2.0), (25, 2.0)]):
        add("tfm", seed, Corruption("data", 200 + 10 * seed, n, f), f"data{n}x{f:g}")
    # LR bursts: too high for a few steps, then back.
    for model, bursts in (("mlp", [(3, 30.0), (10, 30.0), (20, 100.0)]),
                          ("cls", [(3, 20.0), (10, 10.0), (5, 40.0)]),
                          ("gru", [(5, 30.0), (15, 100.0), (3, 300.0)]),
                          ("tfm", [(5, 30.0), (10, 100.0)])):
        for seed, (n, f) in enumerate(bursts):
            add(model, seed + 3, Corruption("lr", 220 + 7 * seed, n, f), f"lr{n}x{f:g}")
    # Permanent changes: the data or the LR stays bad.
    add("mlp", 4, Corruption("data", 230, 0, 3.0), "shift")
    add("cls", 4, Corruption("data", 230, 0, 1.0), "shift")
    add("gru", 4, Corruption("data", 230, 0, 1.0), "shift")
    add("mlp", 5, Corruption("lr", 240, 0, 100.0), "lrstep")
    add("tfm", 5, Corruption("lr", 240, 0, 100.0), "lrstep")
    # LR blow-up (grows every step until it breaks) and NaN batches.
    add("mlp", 6, Corruption("lr_grow", 200, 0, 1.15), "lrgrow")
    add("cls", 6, Corruption("lr_grow", 200, 0, 1.15), "lrgrow")
    add("gru", 6, Corruption("lr_grow", 200, 0, 1.2), "lrgrow")
    add("tfm", 6, Corruption("lr_grow", 200, 0, 1.2), "lrgrow")
    add("mlp", 7, Corruption("nan", 250), "nan")
    add("gru", 7, Corruption("nan", 260), "nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=CORPUS_DIR)
    ap.add_argument("--only", default="", help="only the traces whose name contains this")
    ap.add_argument("--seed-offset", type=int, default=0,
                    help="add this to every seed: a held-out corpus made the same way")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for spec in specs(args.seed_offset):
        if args.only not in spec.name:
            continue
        t0 = time.perf_counter()
        trace = train(spec)
        path = args.out / f"{spec.name}.json"
        path.write_text(json.dumps(trace, separators=(",", ":")) + "\n")
        d = trace["label_details"]
        print(f"{spec.name:24s} {trace['label']:9s} start {d['start_step']!s:>4} back "
              f"{d['back_step']!s:>4} peak x{d['peak_ratio'] or 0:<8.3g} "
              f"{time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()

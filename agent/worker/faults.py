"""Fault injection for the examples and tests: ``--inject KIND@STEP[:key=value...]``.

Kinds: ``crash`` (SIGKILL of the rank during the step), ``hang`` (the rank stops making
progress), ``slow`` (the rank's compute takes ``factor`` times as long from that step on, for
``len`` steps when given, else to the end),
``spike`` (the *data* of global batches STEP..STEP+len-1 is corrupted, so the loss jumps; a
property of those batches, so it comes back if they are trained again) and ``nan`` (the input
of global batch STEP is made non-finite, so the loss is NaN at the step that trains it).
``crash``, ``hang`` and ``slow`` fire once per run: with ``fired_dir`` (the examples pass
their checkpoint directory) a marker file records that a fault fired, so a later attempt that
trains the same step again does not fire it twice while a fault further on still fires in
whichever attempt gets there (a schedule of faults in one run); without it they fire on the
first attempt only.  ``spike`` and ``nan`` are tied to batch indices and fire whenever those
batches are trained.  ``rank`` defaults to 1 for
crash/hang/slow where the world has a rank 1 (else 0); spike and nan hit every rank.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainwarden.agent.protocol import WorkerEventName
from trainwarden.agent.worker.report import current_attempt, get_reporter

FIRED_DIR = ".trainwarden-faults"  # under fired_dir: one marker file per fault that fired

KINDS = ("crash", "hang", "slow", "spike", "nan")


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    length: int | None = None  # spike: batches corrupted (20 if not given); slow: steps
    factor: float = 1.5
    scale: float = 30.0

    @property
    def span(self) -> int:
        """Batches a spike corrupts."""
        return self.length if self.length is not None else 20

    def __str__(self) -> str:
        extra = "".join(f":{k}={v}" for k, v in (("rank", self.rank), ("len", self.length))
                        if v is not None)
        return f"{self.kind}@{self.step}{extra}"


def parse_fault(spec: str) -> Fault:
    """``KIND@STEP[:rank=R][:len=L][:factor=F][:scale=S]``; ValueError says what is wrong."""
    head, *opts = spec.split(":")
    kind, sep, step = head.partition("@")
    if not sep or kind not in KINDS:
        raise ValueError(f"--inject {spec!r}: expected KIND@STEP with KIND one of {KINDS}")
    try:
        at = int(step)
    except ValueError:
        raise ValueError(f"--inject {spec!r}: STEP must be an integer") from None
    if at < 0:
        raise ValueError(f"--inject {spec!r}: STEP must be >= 0")
    kw: dict[str, float | int] = {}
    for opt in opts:
        key, eq, val = opt.partition("=")
        names = {"rank": "rank", "len": "length", "factor": "factor", "scale": "scale"}
        if not eq or key not in names:
            raise ValueError(f"--inject {spec!r}: unknown option {opt!r} "
                             "(rank=R, len=L, factor=F, scale=S)")
        try:
            kw[names[key]] = float(val) if key in ("factor", "scale") else int(val)
        except ValueError:
            raise ValueError(f"--inject {spec!r}: {key} must be a number") from None
    # (each option parsed to its field's type above: int or float)
    fault = Fault(kind, at, **kw)  # type: ignore[arg-type]
    if (fault.length is not None and fault.length < 1) or fault.factor < 1.0:
        raise ValueError(f"--inject {spec!r}: len must be >= 1 and factor >= 1")
    return fault


class FaultInjector:
    """Applies the parsed faults to this rank's training loop."""

    def __init__(self, faults: list[Fault], *, rank: int, world_size: int,
                 attempt: int | None = None, fired_dir: str | os.PathLike[str] | None = None,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rank = rank
        self._sleep = sleep  # injected: a test patching ``time.sleep`` would spin every thread
        self._announced: set[tuple[str, int]] = set()
        if attempt is None:
            attempt = current_attempt() + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.first_attempt = attempt == 0
        self.fired_dir = Path(fired_dir) / FIRED_DIR if fired_dir is not None else None
        default_rank = 1 if world_size > 1 else 0
        self.faults = [f for f in faults
                       if f.kind in ("spike", "nan")
                       or ((f.rank if f.rank is not None else default_rank) == rank
                           and not self._fired_before(f))]

    def _fired_before(self, f: Fault) -> bool:
        if self.fired_dir is None:
            return not self.first_attempt
        return (self.fired_dir / f"{f.kind}@{f.step}").exists()

    def _mark_fired(self, f: Fault) -> None:
        if self.fired_dir is not None and f.kind in ("crash", "hang", "slow"):
            self.fired_dir.mkdir(parents=True, exist_ok=True)
            (self.fired_dir / f"{f.kind}@{f.step}").write_text(f"rank {self.rank}\n")

    def before_step(self, step: int) -> None:
        """Crash or hang here when a fault says so."""
        for f in self.faults:
            if f.step == step and f.kind == "crash":
                self._announce(f, step)
                os.kill(os.getpid(), signal.SIGKILL)
            if f.step == step and f.kind == "hang":
                self._announce(f, step)
                while True:  # alive, making no progress: what a stuck collective looks like
                    time.sleep(3600)

    def _announce(self, f: Fault, step: int) -> None:
        """A ``fault_injected`` event with the time it fired (the detection benchmark measures
        from it); sent and flushed before a crash or hang takes the process."""
        if (f.kind, f.step) in self._announced:
            return
        self._announced.add((f.kind, f.step))
        self._mark_fired(f)
        get_reporter().event(WorkerEventName.FAULT_INJECTED, f"{f.kind}@{f.step} fired", step=step,
                             details={"kind": f.kind, "at": f.step, "rank": self.rank},
                             blocking=f.kind in ("crash", "hang"))

    def slowdown(self, step: int, compute_s: float) -> None:
        """Sleep so this step's compute takes ``factor`` times as long (a straggler)."""
        for f in self.faults:
            if f.kind == "slow" and f.step <= step < f.step + (f.length or 1 << 62):
                self._announce(f, step)
                self._sleep(compute_s * (f.factor - 1.0))

    def data_faults(self, batch_index: int) -> list[Fault]:
        """The spike and nan faults that corrupt global batch ``batch_index`` (announced by
        rank 0); for data that ``corrupt`` cannot handle (token ids, say)."""
        hit = [f for f in self.faults
               if (f.kind == "spike" and f.step <= batch_index < f.step + f.span)
               or (f.kind == "nan" and batch_index == f.step)]
        if self.rank == 0:
            for f in hit:
                self._announce(f, batch_index)
        return hit

    def corrupt(self, batch_index: int, x: torch.Tensor, y: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Corrupt the data of the batches a spike or nan fault names."""
        for f in self.data_faults(batch_index):
            if f.kind == "spike":
                # Large, wrong targets: a loss jump whose gradients wreck the weights and
                # inflate Adam's second moments, so the loss stays high for a long while.
                x = x * f.scale
                y = -y * f.scale + f.scale
            if f.kind == "nan":
                x = torch.full_like(x, float("nan"))
        return x, y

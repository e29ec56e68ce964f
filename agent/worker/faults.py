"""Fault injection for the examples and tests: ``--inject KIND@STEP[:key=value...]``.

Kinds: ``crash`` (SIGKILL of the rank during the step), ``hang`` (the rank stops making
progress), ``slow`` (the rank's compute takes ``factor`` times as long from that step on, for
``len`` steps when given, else to the end),
``spike`` (the *data* of global batches STEP..STEP+len-1 is corrupted, so the loss jumps; a
property of those batches, so it comes back if they are trained again) and ``nan`` (the input
of global batch STEP is made non-finite, so the loss is NaN at the step that trains it).
``bitflip`` flips one bit of one parameter element of the rank after the optimizer step of
step STEP (and of each of the ``len`` steps from it): ``bit=exponent`` (the default) flips an
exponent bit (the value is scaled by 2**8 or 2**-8: large, finite), ``bit=mantissa`` the
third-lowest mantissa bit (a relative change of ~5e-7: subtle), ``bit=N`` bit N of the element's
integer view.  ``node=NAME`` makes it persistent: it fires on the ranks running on node NAME
(``TRAINWARDEN_NODE``; ``rank`` then names the local rank, all of them when not given) on
every attempt that trains those steps, as a machine that corrupts again would.
``crash``, ``hang``, ``slow`` and ``bitflip`` (without ``node``) fire once per run: with
``fired_dir`` (the examples pass their checkpoint directory) a marker file records that a
fault fired, so a later attempt that trains the same step again does not fire it twice while
a fault further on still fires in whichever attempt gets there (a schedule of faults in one
run); without it they fire on the first attempt only.  ``spike`` and ``nan`` are tied to
batch indices and fire whenever those batches are trained.  ``rank`` defaults to 1 for
crash/hang/slow/bitflip where the world has a rank 1 (else 0); spike and nan hit every rank.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainwarden.agent.protocol import ENV_NODE, WorkerEventName
from trainwarden.agent.worker.report import current_attempt, get_reporter

FIRED_DIR = ".trainwarden-faults"  # under fired_dir: one marker file per fault that fired

KINDS = ("crash", "hang", "slow", "spike", "nan", "bitflip")
ONCE = ("crash", "hang", "slow", "bitflip")  # fire once per run (a bitflip with node=: always)
# The bit of a float32's integer view: exponent: x2**+-8; mantissa: 4 units in the last place
# (a relative change of ~5e-7).  Not the lowest bit: a change of one unit in the last place is
# often rounded away by the next optimizer steps (measured: 2 of 20 elements equal again within
# 50 AdamW steps), after which the replicas agree and nothing is left to detect.
BITS = {"exponent": 26, "mantissa": 2}


@dataclass(frozen=True)
class Fault:
    kind: str
    step: int
    rank: int | None = None
    length: int | None = None  # spike: batches corrupted (20 if not given); slow: steps
    factor: float = 1.5
    scale: float = 30.0
    bit: str | None = None  # bitflip: "exponent", "mantissa" or a bit number
    node: str | None = None  # bitflip: persistent, on the ranks of this node

    @property
    def span(self) -> int:
        """Batches a spike corrupts."""
        return self.length if self.length is not None else 20

    def __str__(self) -> str:
        extra = "".join(f":{k}={v}" for k, v in (("rank", self.rank), ("len", self.length),
                                                 ("bit", self.bit), ("node", self.node))
                        if v is not None)
        return f"{self.kind}@{self.step}{extra}"


def parse_fault(spec: str) -> Fault:
    """``KIND@STEP[:rank=R][:len=L][:factor=F][:scale=S][:bit=B][:node=NAME]``; ValueError says
    what is wrong."""
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
    kw: dict[str, float | int | str] = {}
    for opt in opts:
        key, eq, val = opt.partition("=")
        names = {"rank": "rank", "len": "length", "factor": "factor", "scale": "scale",
                 "bit": "bit", "node": "node"}
        if not eq or key not in names:
            raise ValueError(f"--inject {spec!r}: unknown option {opt!r} "
                             "(rank=R, len=L, factor=F, scale=S, bit=B, node=NAME)")
        if key in ("bit", "node") and kind != "bitflip":
            raise ValueError(f"--inject {spec!r}: {key}= is a bitflip option")
        if key == "bit":
            if val not in BITS and not (val.isdigit() and int(val) < 64):
                raise ValueError(f"--inject {spec!r}: bit must be exponent, mantissa or 0-63")
            kw["bit"] = val
            continue
        if key == "node":
            if not val:
                raise ValueError(f"--inject {spec!r}: node= needs a name")
            kw["node"] = val
            continue
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
        node = os.environ.get(ENV_NODE)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.faults = [f for f in faults
                       if f.kind in ("spike", "nan")
                       or (f.node is not None and f.node == node
                           and f.rank in (None, local_rank))
                       or (f.node is None
                           and (f.rank if f.rank is not None else default_rank) == rank
                           and not self._fired_before(f))]

    def _fired_before(self, f: Fault) -> bool:
        if self.fired_dir is None:
            return not self.first_attempt
        return (self.fired_dir / f"{f.kind}@{f.step}").exists()

    def _mark_fired(self, f: Fault) -> None:
        if self.fired_dir is not None and f.kind in ONCE and f.node is None:
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

    def after_step(self, step: int, model: torch.nn.Module) -> None:
        """Flip the bit a ``bitflip`` fault names, after the optimizer step of ``step``."""
        for f in self.faults:
            if f.kind == "bitflip" and f.step <= step < f.step + (f.length or 1):
                self._announce(f, step)
                flip_bit(model, step, f.bit or "exponent")

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


def flip_bit(model: torch.nn.Module, step: int, bit: str) -> tuple[str, int, int]:
    """Flip one bit of one element of the model's first parameter, in place (the element
    moves with ``step``); returns (parameter name, element index, bit)."""
    name, p = next((n, p) for n, p in model.named_parameters() if p.numel() > 0)
    local = p.to_local() if hasattr(p, "to_local") else p
    flat = local.detach().view(-1)
    width = flat.element_size() * 8
    b = BITS.get(bit)
    b = int(bit) if b is None else (b if width == 32 else {"exponent": width - 6,
                                                           "mantissa": 0}[bit])
    ints = flat.view({8: torch.uint8, 16: torch.int16, 32: torch.int32,
                      64: torch.int64}[width])
    i = (step * 7919) % flat.numel()
    with torch.no_grad():
        ints[i] ^= (1 << b) if b < width - 1 else -(1 << b)  # (the sign bit of a signed view)
    return name, i, b

"""Exact fingerprints of the replicated parameters: silent data corruption caught by the
replicas' disagreement, not by the loss.

Data-parallel replicas hold bit-identical parameters after every optimizer step (DDP: every
rank; HSDP: the ranks of one replicate group, each holding the same shard).  Every
``every`` steps ``Fingerprints.check`` computes, on each rank, an exact 64-bit checksum of its
parameters' bytes (or of its shard's, for a DTensor), exchanges it with the other replicas in
one ``all_gather`` of one int64 each, and compares.  A disagreement is reported to the agent
as a ``replica_mismatch`` event (which ranks disagree, the step, the fingerprints, the last
step they agreed at), by one rank; the check never raises into training and never blocks
beyond its collective.

The checksum: each tensor's bytes are read as integers of the element's width (a float32 as
an int32, a bfloat16 as an int16) and summed at that width (wrapping); the sums of the tensors
are mixed in order.  A change of bit k changes the sum by 2**k modulo 2**width, never 0, so a
single flipped bit always changes the fingerprint; several flips that cancel exactly (+2**k on
one element, -2**k on another of the same tensor) would not, and that is the check's one blind
spot beside the ones of any comparison of replicas (see the detection page).

Attribution: with three replicas or more the value most of them hold is taken as the true
one, and the ranks that hold another are named corrupt.  With two (or no strict majority) the
disagreement is reported with every rank as a suspect and no culprit: the rollback to a
checkpoint the replicas agreed on repairs it either way, and a node that does it again is
told apart by the host ledger.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainwarden.agent.protocol import ENV_NODE, WorkerEventName
from trainwarden.agent.worker.report import Reporter, get_reporter

log = logging.getLogger("trainwarden")

DEFAULT_EVERY = 100  # steps between two fingerprint checks (the cost is < 1% of a step's)
_MASK = (1 << 64) - 1
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MIX = 0x9E3779B97F4A7C15  # (the golden ratio's 64-bit constant: mixes the tensors in order)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, or the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def tensor_sums(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """Each tensor's bytes summed as integers of its element's width, wrapping at that width
    (one int64 per tensor, on the tensors' device).  Summing in the element's own width keeps
    the reduction vectorised (widening each int32 to int64 first made it ~20x slower on CPU)
    and loses nothing: a flip of bit k changes the sum by 2**k modulo 2**width, never 0."""
    sums = []
    for t in tensors:
        x = _local(t).detach()
        if x.numel() == 0:
            sums.append(torch.zeros((), dtype=torch.int64, device=x.device))
            continue
        x = x.contiguous().reshape(-1)
        as_int = _INT_OF_WIDTH.get(x.element_size())
        ints = x.view(as_int) if as_int is not None else x.view(torch.uint8)
        sums.append(ints.sum(dtype=ints.dtype).to(torch.int64))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


def fingerprint(tensors: Iterable[torch.Tensor]) -> int:
    """The exact 64-bit fingerprint of these tensors' bytes, in order (a signed int64)."""
    acc = 0
    for i, s in enumerate(tensor_sums(tensors).tolist()):
        acc = (acc * _MIX + (s & _MASK) + i + 1) & _MASK
    return acc - (1 << 64) if acc >= 1 << 63 else acc


@dataclass(frozen=True)
class Verdict:
    """What one check found: the fingerprint of every rank of the group (by group rank), and
    who is out of step."""

    step: int
    values: tuple[int, ...]
    ranks: tuple[int, ...]  # the global rank of each group rank
    agree: bool
    corrupt: tuple[int, ...] = ()  # the minority's global ranks (with a strict majority)
    suspects: tuple[int, ...] = ()  # every rank when no majority can say (two replicas)

    def details(self) -> dict[str, Any]:
        return {"step": self.step, "ranks": list(self.ranks),
                "fingerprints": [f"{v & _MASK:016x}" for v in self.values],
                "corrupt": list(self.corrupt), "suspects": list(self.suspects),
                "replicas": len(self.values)}


def judge(step: int, values: list[int], ranks: list[int]) -> Verdict:
    """Agreement, and the minority when a strict majority holds one value."""
    if len(set(values)) <= 1:
        return Verdict(step, tuple(values), tuple(ranks), True)
    value, n = Counter(values).most_common(1)[0]
    if 2 * n > len(values):
        corrupt = tuple(r for r, v in zip(ranks, values, strict=True) if v != value)
        return Verdict(step, tuple(values), tuple(ranks), False, corrupt=corrupt)
    return Verdict(step, tuple(values), tuple(ranks), False, suspects=tuple(ranks))


@dataclass
class Fingerprints:
    """Compares the replicas' parameters every ``every`` steps (see the module docstring).

    ``group``: the process group of the replicas to compare (default: the whole world, as in
    DDP; for HSDP the replicate dimension's group, ``mesh.get_group("replicate")``; for plain
    FSDP, where no two ranks hold the same shard, there is nothing to compare and ``check``
    returns None).  Call ``check(step)`` after the optimizer step of the step that makes
    ``step`` steps done, on every rank (it is collective on the due steps)."""

    model: torch.nn.Module
    every: int | None = DEFAULT_EVERY
    group: Any = None
    reporter: Reporter | None = None
    last: Verdict | None = None
    last_agreed: int | None = None  # the newest step the replicas agreed at
    first_disagreement: int | None = None
    _reported: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError("Fingerprints(every=...) must be >= 1 (or None: at saves only)")

    @property
    def replicas(self) -> int:
        if not dist.is_initialized():
            return 1
        return int(dist.get_world_size(self.group))

    def due(self, step: int) -> bool:
        return self.every is not None and step > 0 and step % self.every == 0

    def maybe_check(self, step: int) -> Verdict | None:
        """``check`` on the due steps; None on the others.  Never raises."""
        return self.check(step) if self.due(step) else None

    def check(self, step: int) -> Verdict | None:
        """Compare the replicas now (collective over ``group``); the verdict, or None with
        fewer than two replicas or when the comparison could not be made.  Never raises.
        The result of a step already checked is returned again without a collective."""
        if self.last is not None and self.last.step == step:
            return self.last
        if self.replicas < 2:
            return None
        try:
            params = [p for p in self.model.parameters()]
            device = params[0].device if params else torch.device("cpu")
            try:
                mine = fingerprint(params)
            except Exception:  # an unreadable tensor: the rank still joins the collective
                log.exception("trainwarden: fingerprint of step %d failed", step)
                mine = 0
            out = [torch.zeros(1, dtype=torch.int64, device=device)
                   for _ in range(self.replicas)]
            dist.all_gather(out, torch.tensor([mine], dtype=torch.int64, device=device),
                            group=self.group)
            values = [int(t.item()) for t in out]
            ranks = (list(range(self.replicas)) if self.group is None
                     else [dist.get_global_rank(self.group, i) for i in range(self.replicas)])
            verdict = judge(step, values, ranks)
        except Exception:
            log.exception("trainwarden: fingerprint check of step %d failed", step)
            return None
        self.last = verdict
        if verdict.agree:
            if self.first_disagreement is None:
                self.last_agreed = step
        else:
            if self.first_disagreement is None:
                self.first_disagreement = step
            self._report(verdict)
        return verdict

    @property
    def disagreed(self) -> bool:
        return self.first_disagreement is not None

    def _report(self, v: Verdict) -> None:
        """One ``replica_mismatch`` event, sent by the lowest rank that is not corrupt, once
        per process (the first disagreement: the rollback answers it)."""
        if self._reported:
            return
        self._reported = True
        me = dist.get_rank() if dist.is_initialized() else 0
        sender = min((r for r in v.ranks if r not in v.corrupt), default=v.ranks[0])
        if me != sender:
            return
        who = (f"rank(s) {', '.join(map(str, v.corrupt))} disagree with the majority"
               if v.corrupt else
               f"the {len(v.values)} replicas (ranks {', '.join(map(str, v.ranks))}) disagree "
               "and no majority names the corrupt one")
        agreed = (f"; they last agreed at step {self.last_agreed}"
                  if self.last_agreed is not None else "")
        details = {**v.details(), "first_disagreement": self.first_disagreement,
                   "last_agreed_step": self.last_agreed,
                   "reporter_node": os.environ.get(ENV_NODE) or socket.gethostname()}
        with contextlib.suppress(Exception):
            (self.reporter or get_reporter()).event(
                WorkerEventName.REPLICA_MISMATCH,
                f"replica parameter fingerprints disagree at step {v.step}: {who}{agreed}",
                step=v.step, details=details)
        log.error("trainwarden: silent data corruption suspected at step %d: %s", v.step, who)

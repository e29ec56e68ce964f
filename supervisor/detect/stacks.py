"""Hang culprit: which rank is *not* waiting in a collective, read from the ranks' stacks.

In a synchronous job one rank stuck outside the collectives (in a data loader, a deadlock of
its own, an infinite loop, a debugger) leaves every other rank waiting inside the next
collective, so every rank stops at the same step and step progress cannot tell them apart.
Their Python stacks can: the agent dumps every worker's stacks (faulthandler, on ``SIGUSR1``)
before it kills a hung gang, and this module classifies each dump.

A dump is **in a collective** when its training thread (the main thread: threads started by
``threading`` are the library's helpers) is inside ``torch.distributed`` (a c10d collective
such as ``all_reduce``/``barrier``/``broadcast``/``all_gather``/``reduce_scatter``, FSDP's
all-gather and reduce-scatter hooks, DCP's collectives), inside DDP's own collectives
(``torch/nn/parallel/distributed.py``: buffer broadcasts, ``join``), or with the autograd
engine as its innermost Python frame: the engine runs in C++, and under DDP that is where
the reducer waits for the gradient all-reduce (a rank's own backward compute does not take
the tens of seconds a hang deadline is).  Anything else is **elsewhere**, named by its
innermost frame.  A rank whose node sent its dumps but none for that rank did not answer the
signal: stopped (``SIGSTOP``), or stuck in native code that holds the interpreter.

What cannot be seen: a ``work.wait()`` called from the training script itself shows as the
script's own line (C++ has no Python frame), so it reads as elsewhere; the order in which the
ranks entered a collective is not reported by the workers, so when every rank waits in a
collective no rank is named, and the incident says why.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

State = Literal["collective", "elsewhere", "no_dump"]
Via = Literal["", "torch.distributed", "ddp", "backward"]  # "": not in a collective

_HEADER = re.compile(r"^(?:(Current thread)|Thread) (0x[0-9a-fA-F]+)\b.*\(most recent call "
                     r"first\):\s*$|^(Stack) \(most recent call first\):\s*$")
_FRAME = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+) in (?P<func>\S+)')
# DDP's collectives outside torch.distributed (buffer broadcasts before forward, join).
_DDP_FILE = "/torch/nn/parallel/distributed.py"
_DDP_COLLECTIVES = frozenset({
    "_sync_buffers", "_sync_module_buffers", "_default_broadcast_coalesced",
    "_distributed_broadcast_coalesced", "_sync_params", "_check_and_sync_module_buffers",
    "_check_global_requires_backward_grad_sync", "_match_all_reduce_for_bwd_pass",
    "_match_unused_params_allreduce", "join", "_sync_final_model",
})


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        """``func (path/tail.py:line)``: the last two path parts are enough to read."""
        tail = "/".join(self.file.replace("\\", "/").split("/")[-2:])
        return f"{self.func} ({tail}:{self.line})"


@dataclass(frozen=True)
class Thread:
    ident: str
    current: bool
    frames: tuple[Frame, ...]  # innermost first, as faulthandler writes them

    @property
    def helper(self) -> bool:
        """Started through ``threading`` (the reporter, DataLoader pin threads...)."""
        return bool(self.frames) and self.frames[-1].file.endswith("threading.py")


@dataclass(frozen=True)
class DumpClass:
    state: State
    where: str  # what it is doing, for people ("all_reduce (...)", "before_step (...)")
    via: Via = ""  # the way into a collective


def parse_dump(text: str) -> list[Thread]:
    """The threads of a faulthandler dump (other lines around it are ignored)."""
    threads: list[Thread] = []
    ident, current = "", False
    frames: list[Frame] = []
    open_block = False
    for line in text.splitlines():
        h = _HEADER.match(line)
        if h:
            if open_block:
                threads.append(Thread(ident, current, tuple(frames)))
            ident, current, frames, open_block = (h.group(2) or "main",
                                                  bool(h.group(1) or h.group(3)), [], True)
            continue
        f = _FRAME.match(line)
        if f and open_block:
            frames.append(Frame(f.group("file"), int(f.group("line")), f.group("func")))
    if open_block:
        threads.append(Thread(ident, current, tuple(frames)))
    return [t for t in threads if t.frames]


def classify_thread(frames: Iterable[Frame]) -> DumpClass:
    fs = list(frames)
    for f in fs:  # innermost first
        path = f.file.replace("\\", "/")
        if "/torch/distributed/" in path:
            return DumpClass("collective", f.short(), "torch.distributed")
        if path.endswith(_DDP_FILE) and f.func in _DDP_COLLECTIVES:
            return DumpClass("collective", f.short(), "ddp")
    if fs and "/torch/autograd/" in fs[0].file.replace("\\", "/"):
        return DumpClass("collective", f"{fs[0].short()}: in backward, where DDP's reducer "
                         "waits for the gradient all-reduce", "backward")
    return DumpClass("elsewhere", _user_frame(fs).short() if fs else "no Python frame")


def _user_frame(frames: list[Frame]) -> Frame:
    """The innermost frame outside the interpreter's and the installed packages' files (the
    training script or its own modules), else the innermost one."""
    for f in frames:
        p = f.file.replace("\\", "/")
        if "/site-packages/" not in p and "/lib/python" not in p:
            return f
    return frames[0]


def classify_dump(text: str | None) -> DumpClass:
    """In a collective or elsewhere; ``no_dump`` when the text holds no stack."""
    threads = parse_dump(text or "")
    if not threads:
        return DumpClass("no_dump", "no stack dump")
    training = [t for t in threads if not t.helper] or threads
    verdicts = [classify_thread(t.frames) for t in training]
    return next((v for v in verdicts if v.state == "collective"), verdicts[0])


@dataclass(frozen=True)
class Culprit:
    """Who a hang is blamed on.  ``ranks`` empty: nobody could be named, ``reason`` says why."""

    ranks: tuple[int, ...]
    reason: str
    per_rank: dict[int, DumpClass] = field(default_factory=dict)
    waiting_for_nodes: tuple[str, ...] = ()

    def as_details(self) -> dict[str, object]:
        return {"ranks": list(self.ranks), "reason": self.reason,
                "waiting_for_nodes": list(self.waiting_for_nodes),
                "per_rank": {str(r): {"state": c.state, "where": c.where, "via": c.via}
                             for r, c in sorted(self.per_rank.items())}}


def _fmt(ranks: Iterable[int], limit: int = 8) -> str:
    rs = sorted(ranks)
    s = ", ".join(str(r) for r in rs[:limit])
    return s + (f" (+{len(rs) - limit} more)" if len(rs) > limit else "")


def hang_culprit(stacks: Mapping[int, str], rank_nodes: Mapping[int, str],
                 nodes_delivered: Iterable[str]) -> Culprit:
    """Name the ranks of a hung gang that are not waiting in a collective.

    ``stacks``: rank -> dump text of the ranks whose dumps arrived; ``rank_nodes``: every rank
    of the attempt -> its node; ``nodes_delivered``: nodes whose agent sent its dumps (a rank
    of such a node without a dump did not answer).  Ranks named: those elsewhere, then those
    that did not answer, while at least one rank waits in a collective."""
    delivered = set(nodes_delivered)
    ranks = sorted(set(rank_nodes) | set(stacks))
    per: dict[int, DumpClass] = {}
    pending: set[str] = set()
    for r in ranks:
        if r in stacks:
            per[r] = classify_dump(stacks[r])
        elif rank_nodes.get(r) in delivered or not rank_nodes.get(r):
            per[r] = DumpClass("no_dump", "no stack dump: the process did not answer SIGUSR1 "
                               "(stopped, gone, or stuck in native code)")
        else:
            pending.add(rank_nodes[r])
    waiting_for = tuple(sorted(pending))
    if not per:
        return Culprit((), "cannot tell: no stacks were captured", per, waiting_for)
    waiting = [r for r, c in per.items() if c.state == "collective"]
    outside = [r for r, c in per.items() if c.state == "elsewhere"]
    silent = [r for r, c in per.items() if c.state == "no_dump"]
    if pending:
        return Culprit((), f"cannot tell yet: waiting for the stacks of node(s) "
                       f"{', '.join(waiting_for)}", per, waiting_for)
    if len(per) == 1:
        (r,) = per
        return Culprit((r,), f"rank {r} is the only rank ({per[r].where})", per)
    if waiting and (outside or silent):
        named = tuple(sorted(outside) + sorted(silent))
        parts = [f"rank {r} is not in a collective ({per[r].where})" for r in sorted(outside)]
        parts += [f"rank {r} did not answer the stack dump" for r in sorted(silent)]
        first = per[min(waiting)]
        return Culprit(named, "; ".join(parts) + f", while rank(s) {_fmt(waiting)} wait in a "
                       f"collective (rank {min(waiting)}: {first.where})", per)
    if waiting:
        where = {per[r].where.split(" ")[0] for r in waiting}
        what = (f"in the same place ({next(iter(where))})" if len(where) == 1 else
                f"in different places ({', '.join(sorted(where))}: mismatched collectives)")
        return Culprit((), f"cannot tell: every rank waits in a collective {what}; which rank "
                       "entered last is not reported (a network or communication-library "
                       "fault, or a collective only some ranks called)", per)
    if outside:
        return Culprit((), f"cannot tell: no rank waits in a collective (rank(s) "
                       f"{_fmt(outside)} outside, e.g. rank {min(outside)} in "
                       f"{per[min(outside)].where}): not a collective hang of one rank", per)
    return Culprit((), "cannot tell: no rank answered the stack dump (the workers had "
                   "exited or are stopped)", per)

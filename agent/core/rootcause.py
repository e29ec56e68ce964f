"""Why a worker failed, read from what it left: its Python traceback.

Pure, standard library only, shared by the agent (which extracts a root cause per failed rank
from torchrun's error file, its failure summary or the node's stderr) and the supervisor
(which classifies it, fingerprints it and names it on the incident).

Sources, best first:

* torchrun's structured error file (``TORCHELASTIC_ERROR_FILE``, written by
  ``torch.distributed.elastic.multiprocessing.errors.record`` or by the in-training library):
  ``{"message": {"message": "KeyError: 'label'", "extraInfo": {"py_callstack": "Traceback
  ..."}}}``; torchrun prints the same call stack in its failure summary;
* the node's stderr, where each worker's traceback lands.  Once the process group is up,
  torch's own excepthook prefixes each line with ``[rankN]: `` (and ``--tee`` adds
  ``[defaultN]:``), so a traceback is attributed to its rank; without a prefix it is
  attributed only when one rank failed with an exit code;
* a rank that left no traceback at all (argparse's usage error, ``os._exit(1)``, a C library's
  ``abort``): its last lines of stderr (``from_stderr_tail``), torchrun's own lines left out.
  Its summary says only "To enable traceback see: https://pytorch.org/...", which says
  nothing about the failure.

What the worker wrote is untrusted text: everything returned here is cut to bounds, and the
agent passes it through ``trainwarden.agent.core.text`` before it is sent.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from enum import StrEnum
from typing import Any

TAIL_LINES = 40  # the traceback tail kept with the root cause
TAIL_CHARS = 6000
MESSAGE_CHARS = 1000
NAME_CHARS = 300


class FailureClass(StrEnum):
    """Whose fault a worker failure is, as far as its traceback tells."""

    USER_CODE = "user_code"  # a Python exception raised from the training script's own code
    MACHINE = "machine"  # a signal kill, OOM, a NCCL/gloo/c10d error, a lost peer or node
    UNKNOWN = "unknown"  # nothing to tell: no traceback, or one that says neither
    # The file system the script writes to: full (ENOSPC, a quota) or read-only.  Neither
    # the script's bug nor evidence against the machine, and a restart does not fix it.
    STORAGE = "storage"


class RootCauseSource(StrEnum):
    ERROR_FILE = "error_file"  # torchrun's structured error file
    SUMMARY = "summary"  # the traceback in torchrun's failure summary
    STDERR = "stderr"  # parsed from the node's stderr
    LAUNCHER = "launcher"  # torchrun's own traceback: it failed before any worker did
    # No traceback: the last lines the rank wrote to stderr (unprefixed output is the node's:
    # every local rank writes to it).  ``exc_type`` is empty, ``message`` the last line.
    STDERR_TAIL = "stderr_tail"


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str

    @property
    def short(self) -> str:
        """``train.py:57 in collate``"""
        return f"{basename(self.file)}:{self.line} in {self.function}"


@dataclass(frozen=True)
class RootCause:
    """The exception that ended a worker, and where it was raised."""

    exc_type: str  # as printed: "KeyError", "torch.distributed.DistBackendError"
    message: str  # the first line of its message
    frame: Frame | None  # the innermost frame of the traceback
    user_frame: Frame | None  # the innermost frame in the user's code (not a library's)
    traceback: str  # the traceback's last lines
    source: str = RootCauseSource.STDERR
    rank: int | None = None
    host: str | None = None

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["source"] = str(self.source)
        return d


def basename(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


# --------------------------------------------------------------------------------------------
# Parsing a Python traceback

_HEADER = "Traceback (most recent call last):"
_FRAME_RE = re.compile(r'^\s+File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<fn>.+?)\s*$')
_EXC_RE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*)(?::\s?(?P<msg>.*))?$")
# The lines torch's C++ side adds under an exception's message.
_CPP_CONTINUATION = re.compile(
    r"^(?:Exception raised from |C\+\+ CapturedTraceback|frame #\d|#\d+ )")
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")
# Line prefixes added on the way to the log: torchrun --tee's "[default1]:" and torch's
# distributed excepthook's "[rank1]: ".
_PREFIX_RE = re.compile(r"^(?:\[(?!rank\d)[A-Za-z_]*\d+\]:)?(?:\[rank(?P<rank>\d+)\]: ?)?")
_LIBRARY_PARTS = ("/site-packages/", "/dist-packages/", "/torch/", "/trainwarden/agent/")
_STDLIB_RE = re.compile(r"/lib/python\d+(?:\.\d+)?/")
# torchrun's own traceback when a worker failed: never a worker's root cause.
_LAUNCHER_EXCEPTIONS = ("ChildFailedError",)
# What torchrun's summary says of a worker that wrote no error file: a link to its docs,
# nothing about the failure.
TORCHRUN_HINT = "To enable traceback see:"


def is_user_file(path: str) -> bool:
    """Whether a traceback frame's file is the user's code, not an installed library's, the
    standard library's or the interpreter's (``<frozen runpy>``, ``<string>``)."""
    p = path.replace("\\", "/")
    if not p or p.startswith("<"):
        return False
    if any(part in p for part in _LIBRARY_PARTS):
        return False
    return _STDLIB_RE.search(p) is None


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 3] + "..."


def _tail(lines: list[str]) -> str:
    text = "\n".join(lines[-TAIL_LINES:]).strip("\n")
    return text if len(text) <= TAIL_CHARS else "..." + text[-(TAIL_CHARS - 3):]


def _parse_at(lines: list[str], h: int) -> tuple[RootCause | None, int]:
    """The exception of the traceback whose header is line ``h``, and the line after it."""
    frames: list[Frame] = []
    i, n = h + 1, len(lines)
    while i < n and (lines[i][:1].isspace() or not lines[i].strip()):
        if m := _FRAME_RE.match(lines[i]):
            frames.append(Frame(_cut(m.group("file"), NAME_CHARS), int(m.group("line")),
                                _cut(m.group("fn"), NAME_CHARS)))
        i += 1
    m = _EXC_RE.match(lines[i].rstrip()) if i < n else None
    if m is None:
        return None, i
    end = i + 1
    while end < n and end - i <= TAIL_LINES and _CPP_CONTINUATION.match(lines[end]):
        end += 1  # a C++ error's source location and stack (what follows is another's)
    message = (m.group("msg") or "").strip()
    shown = min(end, i + 4)  # the C++ side's first lines only
    if m.group("type").endswith("CheckpointException"):
        end, failures = _rank_failures(lines, end)
        shown = end
        if failures:  # its message names only the ranks: say what the first one failed of
            message += f" ({failures[0]})"
    user = next((f for f in reversed(frames) if is_user_file(f.file)), None)
    rc = RootCause(
        exc_type=_cut(m.group("type"), NAME_CHARS),
        message=_cut(message, MESSAGE_CHARS),
        frame=frames[-1] if frames else None,
        user_frame=user,
        # The Python part whole (up to its bound), then what follows the exception's line.
        traceback=_tail(lines[_chain_start(lines, h):i + 1] + lines[i + 1:shown]),
    )
    return rc, end


_RANK_HEADER = re.compile(r"^Traceback \(most recent call last\): \(RANK (\d+)\)\s*$")


def _rank_failures(lines: list[str], start: int) -> tuple[int, list[str]]:
    """DCP's ``CheckpointException`` prints each failed rank's traceback under its message
    (``Traceback (most recent call last): (RANK 0)``, frames, the exception's line): the
    line after them, and ``RANK 0: OSError: [Errno 28] ...`` for each."""
    j, n, out = start, len(lines), []
    while j < n and j - start <= TAIL_LINES and (mh := _RANK_HEADER.match(lines[j])):
        j += 1
        while j < n and (lines[j][:1].isspace() or not lines[j].strip()):
            j += 1
        if j < n and _EXC_RE.match(lines[j].rstrip()):
            out.append(f"RANK {mh.group(1)}: {lines[j].strip()}")
            j += 1
    return j, out


def _chain_start(lines: list[str], h: int) -> int:
    """The first header of the chain ("During handling of the above exception ...") that the
    traceback at ``h`` ends."""
    while True:
        k = h - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        if k < 0 or not lines[k].startswith(_CHAIN):
            return h
        prev = max((j for j in range(k) if lines[j].strip() == _HEADER), default=None)
        if prev is None:
            return h
        h = prev


def parse_traceback(text: str) -> RootCause | None:
    """The last exception raised in ``text`` (the final one of a chain; a launcher's own
    traceback is passed over), or None when there is no Python traceback."""
    lines = text.splitlines()
    headers = [i for i, ln in enumerate(lines) if ln.strip() == _HEADER]
    for h in reversed(headers):
        rc, _ = _parse_at(lines, h)
        if rc is not None and not rc.exc_type.endswith(_LAUNCHER_EXCEPTIONS):
            return rc
    return None


def split_by_rank(text: str) -> dict[int | None, str]:
    """The lines of a node's output grouped by the rank that wrote them (their ``[rankN]:``
    prefix, else ``--tee``'s local-rank prefix is not enough: None), prefixes removed."""
    groups: dict[int | None, list[str]] = {}
    for ln in text.splitlines():
        m = _PREFIX_RE.match(ln)
        rank = int(m.group("rank")) if m and m.group("rank") is not None else None
        groups.setdefault(rank, []).append(ln[m.end():] if m else ln)
    return {k: "\n".join(v) for k, v in groups.items()}


# --------------------------------------------------------------------------------------------
# torchrun's error file and failure summary


def from_error_file(data: Any) -> RootCause | None:
    """A root cause from the JSON of torchrun's error file (None if it is not one)."""
    if not isinstance(data, Mapping):
        return None
    msg = data.get("message")
    if isinstance(msg, str):  # a non-Python error: a JSON string of its own
        try:
            msg = json.loads(msg)
        except ValueError:
            return None
    if not isinstance(msg, Mapping):
        return None
    extra = msg.get("extraInfo")
    stack = extra.get("py_callstack") if isinstance(extra, Mapping) else None
    rc = parse_traceback(stack) if isinstance(stack, str) else None
    if rc is None:
        return None
    return _with(rc, source=RootCauseSource.ERROR_FILE)


_ENTRY_RE = re.compile(r"^\[\d+\]:\s*$")
_RANK_RE = re.compile(r"^\s*rank\s*:\s*(-?\d+)")
_FIELD_RE = re.compile(r"^\s{2}(time|host|rank|exitcode|error_file|traceback)\s*:\s?(.*)$")


def summary_details(text: str) -> dict[int, dict[str, str]]:
    """rank -> {host, error_file, traceback} from torchrun's last failure summary in
    ``text`` (fields it did not print are absent; ``<N/A>`` counts as not printed)."""
    lines = text.splitlines()
    start = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].strip() == "Failures:"),
                 None)
    if start is None:
        return {}
    out: dict[int, dict[str, str]] = {}
    cur: dict[str, str] | None = None
    trace: list[str] | None = None
    for ln in lines[start + 1:]:
        if _ENTRY_RE.match(ln) or ln.startswith(("=", "-", "Root Cause")):
            if cur is not None and trace is not None:
                cur["traceback"] = "\n".join(trace)
            cur, trace = ({}, None) if _ENTRY_RE.match(ln) else (None, None)
            continue
        if cur is None:
            continue
        if m := _FIELD_RE.match(ln):
            key, value = m.group(1), m.group(2).strip()
            trace = None
            if key == "rank" and (r := _RANK_RE.match(ln)):
                out[int(r.group(1))] = cur
            elif key == "traceback":
                trace = [value]
            elif key in ("host", "error_file") and value and value != "<N/A>":
                cur[key] = value
        elif trace is not None:
            trace.append(ln[2:] if ln.startswith("  ") else ln)
    if cur is not None and trace is not None:
        cur["traceback"] = "\n".join(trace)
    return out


def from_summary(trace: str) -> RootCause | None:
    rc = parse_traceback(trace) if trace.startswith(_HEADER) else None
    return None if rc is None else _with(rc, source=RootCauseSource.SUMMARY)


def from_stderr(text: str, *, rank: int, sole_failure: bool) -> RootCause | None:
    """``rank``'s traceback in the node's stderr: under its ``[rankN]:`` prefix, or (when
    ``sole_failure``: the one rank that exited with an error code) an unprefixed one."""
    groups = split_by_rank(text)
    rc = parse_traceback(groups[rank]) if rank in groups else None
    if rc is None and sole_failure and None in groups:
        rc = parse_traceback(groups[None])
    return None if rc is None else _with(rc, source=RootCauseSource.STDERR)


def from_launcher(text: str) -> RootCause | None:
    """torchrun's own failure, from the node's stderr, when it exited with an error and
    named no failed worker (its rendezvous failed, say): the last traceback there that no
    rank wrote, unless it is torchrun's report of a failed worker (``ChildFailedError``: the
    worker's failure is the root cause, not torchrun's).  None of its frames is the user's
    (torchrun's own script would pass for it)."""
    lines = split_by_rank(text).get(None, "").splitlines()
    last = max((i for i, ln in enumerate(lines) if ln.strip() == _HEADER), default=None)
    rc = _parse_at(lines, last)[0] if last is not None else None
    if rc is None or rc.exc_type.endswith(_LAUNCHER_EXCEPTIONS):
        return None
    return _with(rc, source=RootCauseSource.LAUNCHER, user_frame=None)


def _with(rc: RootCause, **changes: Any) -> RootCause:
    return replace(rc, **changes)


# --------------------------------------------------------------------------------------------
# A rank's last lines of stderr, when it left no traceback

STDERR_TAIL_LINES = 20  # kept as the root cause's "traceback"
SIGNATURE_LINES = 5  # of those, the distinct last ones that identify a failure
# torchrun's own log lines (and torch's Python-side ones in a worker): glog's format,
# "W1206 01:54:25.565000 12499 torch/distributed/run.py:874] ...".
_TORCH_LOG_RE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d(?:\.\d+)?\s+\d+ torch/\S*\] ?")


def _worker_lines(text: str) -> list[str]:
    """The non-blank lines of ``text`` a worker wrote: torchrun's log lines, its traceback of
    a failed worker (``ChildFailedError``) and its failure summary left out."""
    lines = text.splitlines()
    end = len(lines)
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].strip() == _HEADER:
            rc, _ = _parse_at(lines, i)
            if rc is not None and rc.exc_type.endswith(_LAUNCHER_EXCEPTIONS):
                end = i  # torchrun's report of the failure: what follows is torchrun's
                break
    if (summary := next((i for i in range(end - 1, -1, -1)
                         if lines[i].strip() == "Failures:"), None)) is not None:
        end = summary  # a summary with no traceback before it: its own banner goes too
        while end > 0 and (lines[end - 1].startswith(("=", "-"))
                           or lines[end - 1].rstrip().endswith(" FAILED")):
            end -= 1
    return [ln for ln in lines[:end] if ln.strip() and not _TORCH_LOG_RE.match(ln)]


def from_stderr_tail(text: str, *, rank: int) -> RootCause | None:
    """What ``rank`` wrote last to the node's stderr when it left no traceback: its own
    (``[rankN]:``-prefixed) lines where it has some, else the node's unprefixed lines (every
    local rank writes there before its process group is up).  None when nothing is left
    once torchrun's own lines are out.  The message is the last line: the one a program
    that exits on an error prints last (argparse's ``error: argument ...``)."""
    groups = split_by_rank(text)
    lines = _worker_lines(groups.get(rank, "")) or _worker_lines(groups.get(None, ""))
    if not lines:
        return None
    tail = lines[-STDERR_TAIL_LINES:]
    return RootCause(exc_type="", message=_cut(tail[-1].strip(), MESSAGE_CHARS), frame=None,
                     user_frame=None, traceback=_tail(tail),
                     source=RootCauseSource.STDERR_TAIL, rank=rank)


def has_traceback(rc: RootCause | None) -> bool:
    """Whether the root cause is an exception (else: only the rank's last lines of stderr)."""
    return rc is not None and bool(rc.exc_type)


# --------------------------------------------------------------------------------------------
# What the supervisor makes of one: a class, a fingerprint, a line


def from_dict(d: Any) -> RootCause | None:
    """A root cause from its wire dict (as ``as_dict`` made it); None if it is not one."""
    if not isinstance(d, Mapping) or not isinstance(d.get("exc_type"), str):
        return None

    def frame(x: Any) -> Frame | None:
        if not isinstance(x, Mapping):
            return None
        f, ln, fn = x.get("file"), x.get("line"), x.get("function")
        if not (isinstance(f, str) and isinstance(ln, int) and isinstance(fn, str)):
            return None
        return Frame(f, ln, fn)

    rank = d.get("rank")
    host = d.get("host")
    return RootCause(
        exc_type=d["exc_type"], message=str(d.get("message") or ""),
        frame=frame(d.get("frame")), user_frame=frame(d.get("user_frame")),
        traceback=str(d.get("traceback") or ""), source=str(d.get("source") or ""),
        rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        host=host if isinstance(host, str) else None)


# Exceptions and messages of the machine and the fabric, not of the script: a retry may pass.
# PreflightFailed (trainwarden.agent.worker.preflight) is a device or fabric found faulty
# before the first step; raised under the script's call to init_distributed, it would
# otherwise read as the script's own bug.
_MACHINE_TYPES = re.compile(
    r"(?:^|\.)(?:DistError|DistBackendError|DistNetworkError|DistStoreError|"
    r"OutOfMemoryError|MemoryError|RendezvousError\w*|ConnectionError|ConnectionResetError|"
    r"BrokenPipeError|TimeoutError|PreflightFailed)$")
_MACHINE_WORDS = re.compile(
    r"nccl|gloo|c10d|connection reset|connection closed by peer|connection refused|"
    r"broken pipe|out of memory|cuda error|cudnn|ecc error|xid|timed out|watchdog|"
    r"device-side assert|illegal memory access|no cuda gpus|socket", re.IGNORECASE)


_STORAGE = {
    "disk full": re.compile(r"\[Errno (?:28|122)\]|No space left on device|"
                            r"Disk quota exceeded|\bENOSPC\b|\bEDQUOT\b", re.IGNORECASE),
    "file system read-only": re.compile(r"\[Errno 30\]|Read-only file system|\bEROFS\b",
                                        re.IGNORECASE),
}


def storage_failure(rc: RootCause | None) -> str | None:
    """What the failure says of the disk it wrote to: ``"disk full"`` (ENOSPC, a quota),
    ``"file system read-only"``, or None.  DCP's ``CheckpointException`` names only the
    ranks in its message (``CheckpointException ranks:dict_keys([0, 1])``); each rank's own
    failure is in its traceback, which is read too."""
    if rc is None:
        return None
    said = f"{rc.exc_type}: {rc.message}"
    if rc.exc_type.endswith("CheckpointException"):
        said += "\n" + rc.traceback
    return next((what for what, pattern in _STORAGE.items() if pattern.search(said)), None)


def classify(rc: RootCause | None, *, exit_code: int | None = None,
             signal: int | None = None) -> FailureClass:
    """Whose fault: a signal kill (the OOM killer's SIGKILL included) or a distributed,
    memory or device error is the machine's; a Python exception raised from a frame of the
    user's script (not inside torch.distributed) is the user's code; a full or read-only
    disk is the storage's (``storage_failure``: DCP's save fails inside torch.distributed,
    which would read as the machine's); the rest is unknown."""
    if storage_failure(rc) is not None and not signal:
        return FailureClass.STORAGE
    if rc is None or not has_traceback(rc):
        killed = bool(signal) or (exit_code is not None and exit_code < 0)
        # Without a traceback, the last line of stderr may still name the fabric or memory.
        said = rc is not None and _MACHINE_WORDS.search(rc.message) is not None
        return FailureClass.MACHINE if killed or said else FailureClass.UNKNOWN
    if _MACHINE_TYPES.search(rc.exc_type) or _MACHINE_WORDS.search(
            f"{rc.exc_type}: {rc.message}"):
        return FailureClass.MACHINE
    if rc.frame is not None and "/torch/distributed/" in rc.frame.file.replace("\\", "/"):
        return FailureClass.MACHINE
    if rc.user_frame is not None:
        return FailureClass.USER_CODE
    return FailureClass.UNKNOWN


_PORT_IN_USE = re.compile(r"EADDRINUSE|address already in use", re.IGNORECASE)


def port_in_use(rc: RootCause | None) -> bool:
    """Whether the failure is a socket that could not listen because its port is taken (the
    rendezvous host's c10d store, say: another process, or a client connection's local end,
    holds the port)."""
    return rc is not None and bool(_PORT_IN_USE.search(f"{rc.exc_type}: {rc.message}"))


def fingerprint(rc: RootCause | None, *, exit_code: int | None = None,
                signal: int | None = None) -> str | None:
    """The identity of a failure of the user's code: its exception type and innermost user
    frame (file name, line, function), whatever the step or the message's values; None for
    any other failure.  Two attempts failing with the same fingerprint is a deterministic bug."""
    if rc is None or rc.user_frame is None or \
            classify(rc, exit_code=exit_code, signal=signal) != FailureClass.USER_CODE:
        return None
    f = rc.user_frame
    key = f"{rc.exc_type}|{basename(f.file)}|{f.line}|{f.function}"
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


# What makes two failures' last lines differ though the failure is the same: addresses,
# clocks, process ids, the log prefix of torch's C++ side ("[W1206 01:56:06.468 ...]").
_VOLATILE = (
    (re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d(?:\.\d+)?\s+\d+\s*"), ""),
    (re.compile(r"0x[0-9a-fA-F]+"), "0x?"),
    (re.compile(r"\d{4}-\d\d-\d\d(?:[ T_]\d\d:\d\d:\d\d(?:[.,]\d+)?)?"), "<time>"),
    (re.compile(r"\b\d\d:\d\d:\d\d(?:[.,]\d+)?"), "<time>"),
    (re.compile(r"\b(pid|PID)([\s:=]+)\d+"), r"\1\2?"),
)


def _normalised(line: str) -> str:
    line = line.strip()
    for pattern, repl in _VOLATILE:
        line = pattern.sub(repl, line)
    return line


def last_distinct_lines(text: str, n: int = SIGNATURE_LINES) -> list[str]:
    """The last ``n`` distinct lines of ``text`` (normalised: no clock, address or pid), in
    the order of their last occurrence.  Ranks that print the same lines interleave them in
    an order that varies from run to run (two argparse usage errors); each line's last
    occurrence keeps the order one rank printed them in, whatever the interleaving."""
    seen: set[str] = set()
    out: list[str] = []
    for ln in reversed(text.splitlines()):
        key = _normalised(ln)
        if key and key not in seen:
            seen.add(key)
            out.append(key)
            if len(out) == n:
                break
    return out[::-1]


def signature(rc: RootCause | None, *, ranks: Sequence[int], exit_code: int | None,
              signal: int | None, phase: str) -> str | None:
    """The identity of a failure by what it left, whatever its class: the rank or ranks
    (``ranks``), the exit code or signal, the last distinct lines it left (its traceback's
    end, or its last lines of stderr) and the phase it failed in (``phase``: before the first
    step, or the step).  Two attempts in a row failing with the same signature failed the
    same way with no progress between them: a third would too.  None when nothing was left
    to read: an empty stderr identifies no failure."""
    if rc is None:
        return None
    lines = last_distinct_lines(rc.traceback or rc.message)
    if not lines:
        return None
    key = json.dumps([sorted(ranks), exit_code, signal, phase, lines])
    return hashlib.blake2b(key.encode(), digest_size=8).hexdigest()


def headline(rc: RootCause, *, rank: int | None = None, host: str | None = None) -> str:
    """``KeyError: 'label' at train.py:57 in collate (rank 1, host node1)``; without a
    traceback, the last line of stderr: ``last stderr line: "error: ..." (rank 0, host h)``"""
    if has_traceback(rc):
        what = f"{rc.exc_type}: {rc.message}" if rc.message else rc.exc_type
    else:
        what = f'last stderr line: "{rc.message}"'
    where = rc.user_frame or rc.frame
    out = what + (f" at {where.short}" if where is not None else "")
    who = [f"rank {rank}"] if rank is not None else []
    if host:
        who.append(f"host {host}")
    return out + (f" ({', '.join(who)})" if who else "")


def of_incident(details: Any) -> tuple[FailureClass | None, RootCause | None]:
    """(whose fault, root cause) as the policy put them on a crash incident's details; (None,
    None) for an incident without them (another kind, or opened before they were kept)."""
    if not isinstance(details, Mapping):
        return None, None
    cls = details.get("failure_class")
    return (FailureClass(cls) if cls in set(FailureClass) else None,
            from_dict(details.get("root_cause")))

"""Node health: which failures are evidence against a node, and the rule that cordons one.

Pure, the clock passed in.  The evaluator reads the incidents, events and GPU readings, turns
them into evidence with the functions below, records it in the health ledger
(``trainwarden.supervisor.store.hosts``) and asks ``judge`` about each node that got some;
the policy turns a verdict into a ``Cordon``.

What counts against a node, and as what (``EvidenceKind``):

* ``infra_failure``: a crash whose root cause is the machine's (``rootcause.classify``: a
  signal kill, a NCCL/gloo/c10d or CUDA error, a lost device), blamed on the node whose rank
  failed first; and a collective timeout, against the node of the rank that timed out.
  Never a failure of the user's code (a Python exception raised from the training script),
  and never one nobody can attribute (``unknown``: an exit code without a traceback may be
  the script's own ``sys.exit``).  Two machine failures are left out on purpose: running out
  of memory (the workload's size far more often than the machine's fault) and a peer's
  connection lost (reset or closed by the peer, a broken pipe, torchrun's connection to the
  rendezvous store lost when the node hosting it died: the symptom a survivor shows when
  another node died, and that node's own failure is its evidence).  Nor is a failure of
  torchrun itself before any worker ran (its rendezvous: a port taken, a peer that never
  came): the node's devices had no part in it.  A collective
  timeout names the rank that waited, not the one that never arrived: ``collective_timeouts``
  turns counting them off.
* ``hang_culprit``: a hang whose culprit analysis (``detect.stacks``) names a rank on the node
  that did not answer the stack dump (stopped, gone, stuck in native code).  A rank that
  answered from somewhere in the training script is the script's business (a data loader, a
  deadlock of its own) and is not evidence.
* ``straggler``: a sustained straggler episode (the straggler incident) of a rank on the node.
* ``ecc``, ``xid``: NVML's uncorrected ECC count of one of the node's GPUs grew (or is above 0
  when first seen), and likewise the count of XID errors an agent reports (``xid_errors``:
  the hardware kind only; the application's own, 13/31/43/45, are the agent's to leave out).
* ``preflight_failed``: a ``preflight`` event whose details say ``passed: false``.
* ``disk_error``: a checkpoint save that failed on an I/O error or a read-only file system.
  Not a full disk (the disk detector's business), neither a failed save nor a crash on one
  (``rootcause.FailureClass.STORAGE``): a disk that fills says nothing against the machine.

The rule (``CordonConfig``, the ``cordon`` settings), over the evidence of the last
``window_s`` seconds that came after the node's last uncordon: any failed preflight, any new
uncorrected ECC or XID error, ``infra_failures`` infrastructure failures (hang culprits
included), ``disk_errors`` disk errors, ``stragglers`` straggler episodes (0 turns a rule
off).  The first that holds names the rule and the evidence it rests on.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from trainwarden.agent.core import rootcause
from trainwarden.agent.core.bounds import bounded, check
from trainwarden.agent.core.rootcause import FailureClass
from trainwarden.supervisor.enums import EvidenceKind, IncidentKind

__all__ = ["CordonConfig", "CordonVerdict", "Evidence", "Found", "disk_fault",
           "gpu_evidence", "incident_evidence", "judge", "preflight_result"]

SUMMARY_CHARS = 300  # of a failure's cause kept with its evidence


# The rule (a ``CordonConfig`` field) that cordons a node for silent data corruption.
SDC_RULE = "sdc"


@dataclass(frozen=True)
class CordonConfig:
    SECTION: ClassVar[str] = "cordon"

    # cordon nodes on the rule below (false: the ledger is still kept, only operators cordon)
    enabled: bool = True
    # seconds of evidence the rule counts (the evidence before a node's uncordon never counts)
    window_s: float = bounded(86400.0, gt=0, hint="e.g. 86400 (a day)")
    # infrastructure failures (machine crashes, collective timeouts, hang culprits) that
    # cordon a node within the window; 0: never on failures
    infra_failures: int = bounded(2, ge=0, hint="0 turns the rule off")
    # count collective timeouts among the infrastructure failures (they name the rank that
    # waited, not the one that never arrived)
    collective_timeouts: bool = True
    # new uncorrected ECC errors that cordon a node within the window; 0: never on ECC
    ecc_errors: int = bounded(1, ge=0, hint="0 turns the rule off")
    # new hardware XID errors (as the agent reports them) that cordon a node; 0: never
    xid_errors: int = bounded(1, ge=0, hint="0 turns the rule off")
    on_failed_preflight: bool = True  # a failed preflight cordons the node at once
    # checkpoint saves failed on a disk I/O error that cordon a node; 0 (the default): never,
    # since a shared file system failing fails every node at once
    disk_errors: int = bounded(0, ge=0, hint="0 turns the rule off")
    # sustained straggler episodes that cordon a node; 0 (the default): recorded, never
    # cordons (a slow rank may be its data's fault)
    stragglers: int = bounded(0, ge=0, hint="0 turns the rule off")
    # silent data corruptions attributed to a rank of the node (its replicas outvoted it)
    # that cordon it within the window: the second is a persistent fault of the machine
    sdc: int = bounded(2, ge=0, hint="0 turns the rule off")

    def __post_init__(self) -> None:
        check(self)


# ---------------------------------------------------------------------------------------------
# what counts, and as what


@dataclass(frozen=True)
class Found:
    """A piece of evidence against ``node``, before it is recorded."""

    node: str
    kind: EvidenceKind
    detail: dict[str, Any]


# The symptoms of another node's death, and memory exhaustion (see the module's docstring).
_PEER_LOST = re.compile(r"connection reset by peer|connection closed by peer|broken pipe|"
                        r"peer closed|connection refused|ConnectionResetError|BrokenPipeError|"
                        r"RendezvousConnectionError",
                        re.IGNORECASE)
_OUT_OF_MEMORY = re.compile(r"out of memory|OutOfMemoryError|MemoryError|\bOOM\b",
                            re.IGNORECASE)


def lost_peer(details: Mapping[str, Any]) -> bool:
    """Whether a crash incident's root cause (its details, as the policy put them) is a lost
    peer connection: what the survivors of another node's death show."""
    _, rc = rootcause.of_incident(details)
    return rc is not None and bool(_PEER_LOST.search(f"{rc.exc_type}: {rc.message}"))


def _summary(cause: str) -> str:
    return cause if len(cause) <= SUMMARY_CHARS else cause[:SUMMARY_CHARS - 3] + "..."


def _int(x: Any) -> int | None:
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def incident_evidence(kind: str, *, node: str | None, rank: int | None, cause: str,
                      details: Mapping[str, Any], rank_nodes: Mapping[int, str],
                      signal: int | None = None, exit_code: int | None = None
                      ) -> list[Found]:
    """The evidence an incident holds against nodes (none for most): see the module's
    docstring.  ``node``, ``rank``, ``signal``, ``exit_code``: the incident's (the failed
    rank's); ``rank_nodes``: the run's ranks' nodes (a hang's culprit ranks are named by
    rank)."""
    base: dict[str, Any] = {"incident_kind": kind, "summary": _summary(cause)}
    if rank is not None:
        base["rank"] = rank
    if kind == IncidentKind.CRASH:
        cls, rc = rootcause.of_incident(details)
        if node is None or cls != FailureClass.MACHINE:
            return []
        said = f"{rc.exc_type}: {rc.message}" if rc is not None else ""
        if _PEER_LOST.search(said) or _OUT_OF_MEMORY.search(said):
            return []
        if rc is not None and rc.source == rootcause.RootCauseSource.LAUNCHER:
            return []
        how = (f"killed by signal {signal}" if signal else said or
               (f"exit code {exit_code}" if exit_code is not None else "crashed"))
        return [Found(node, EvidenceKind.INFRA_FAILURE, {**base, "what": f"crash ({how})"})]
    if kind == IncidentKind.COLLECTIVE_TIMEOUT:
        if node is None:
            return []
        what = f"collective timeout in {details.get('collective') or 'a collective'}"
        return [Found(node, EvidenceKind.INFRA_FAILURE, {**base, "what": what})]
    if kind == IncidentKind.SDC:
        if node is None:
            return []
        return [Found(node, EvidenceKind.SDC,
                      {**base, "what": "silent data corruption (its replicas outvoted it)"})]
    if kind == IncidentKind.STRAGGLER:
        if node is None:
            return []
        return [Found(node, EvidenceKind.STRAGGLER, {**base, "what": "sustained straggler"})]
    if kind == IncidentKind.HANG:
        culprit = details.get("culprit")
        if not isinstance(culprit, Mapping):
            return []
        per_rank = culprit.get("per_rank")
        per_rank = per_rank if isinstance(per_rank, Mapping) else {}
        silent: dict[str, list[int]] = {}
        for r in culprit.get("ranks") or []:
            r = _int(r)
            state = (per_rank.get(str(r)) or {}).get("state") if r is not None else None
            if r is not None and state == "no_dump" and rank_nodes.get(r):
                silent.setdefault(rank_nodes[r], []).append(r)
        return [Found(n, EvidenceKind.HANG_CULPRIT,
                      {**base, "ranks": rs,
                       "what": f"hang: rank(s) {', '.join(map(str, rs))} did not answer the "
                               "stack dump"})
                for n, rs in sorted(silent.items())]
    return []


def preflight_result(details: Mapping[str, Any]) -> bool | None:
    """A ``preflight`` event's verdict: passed (True), failed (False), or None when its
    details say neither."""
    passed = details.get("passed")
    return passed if isinstance(passed, bool) else None


_DISK_FAULT = re.compile(r"\[Errno (?:5|30)\]|Input/output error|Read-only file system|"
                         r"\bEIO\b|\bEROFS\b", re.IGNORECASE)


# A failed save's ``reason`` (``trainwarden.agent.worker.save_failure``) that is the disk's
# fault: a full disk is its filling's (another run's files, retention set too high), a
# vanished directory its owner's.
_DISK_FAULT_REASONS = frozenset({"io_error", "read_only"})


def disk_fault(message: str, reason: Any = None) -> bool:
    """Whether a failed checkpoint save is the disk's fault (an I/O error, a file system
    gone read-only), not the script's nor a full disk's: by its ``reason`` where the worker
    gave one, else by its message."""
    if isinstance(reason, str):
        return reason in _DISK_FAULT_REASONS
    return _DISK_FAULT.search(message) is not None


# The GPU readings' counters that are evidence when they grow: reading key -> (counter name,
# evidence kind).  NVML's counts are volatile (a driver reload resets them).
GPU_COUNTERS: dict[str, tuple[str, EvidenceKind]] = {
    "ecc_uncorrected": ("ecc", EvidenceKind.ECC),
    "xid_errors": ("xid", EvidenceKind.XID),
}


def gpu_evidence(reading: Mapping[str, Any], seen: Mapping[str, Any]
                 ) -> tuple[list[tuple[EvidenceKind, dict[str, Any]]], dict[str, Any]]:
    """(evidence, the counters to keep) from one node's GPU reading, given the counters last
    seen (``{"ecc": {"0": 2}, "xid": {...}}``): a count above the last seen is evidence of
    the difference (above 0 on a GPU never seen: all of it); one below it was reset (a driver
    reload) and is kept as the new base; a count not read keeps the last seen."""
    out: list[tuple[EvidenceKind, dict[str, Any]]] = []
    kept: dict[str, dict[str, int]] = {}
    for name, _ in GPU_COUNTERS.values():
        before = seen.get(name)  # (a stored value of another shape counts as never seen)
        kept[name] = ({str(k): v for k, v in before.items() if _int(v) is not None}
                      if isinstance(before, Mapping) else {})
    devices = reading.get("devices")
    for d in devices if isinstance(devices, list) else []:
        if not isinstance(d, Mapping) or d.get("index") is None:
            continue
        gpu = str(d["index"])
        for key, (name, kind) in GPU_COUNTERS.items():
            now = _int(d.get(key))
            if now is None or now < 0:
                continue
            before = kept[name].get(gpu)
            kept[name][gpu] = now
            grew = now if before is None else now - before
            if grew > 0:
                detail: dict[str, Any] = {"gpu": gpu, "count": grew, "total": now,
                                          "what": f"{grew} new {_GPU_WHAT[kind]} on GPU {gpu}"}
                if kind == EvidenceKind.XID and _int(d.get("xid_last")) is not None:
                    detail["xid_last"] = d["xid_last"]
                    detail["what"] += f" (newest XID {d['xid_last']})"
                out.append((kind, detail))
    return out, kept


_GPU_WHAT = {EvidenceKind.ECC: "uncorrected ECC error(s)", EvidenceKind.XID: "XID error(s)"}


# ---------------------------------------------------------------------------------------------
# the rule


@dataclass(frozen=True)
class Evidence:
    """A recorded piece of evidence, as the rule reads it (``detail``: ``what`` happened,
    the ``run`` it happened in, a ``count`` for the GPU counters)."""

    id: int
    kind: str
    t: float
    attempt: int | None = None
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CordonVerdict:
    """The rule that holds (its setting's name) and the evidence it rests on."""

    rule: str
    reason: str
    evidence_ids: tuple[int, ...]


def _when(t: float) -> str:
    try:
        return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, ValueError, OSError):
        return "an invalid time"


def describe(e: Evidence) -> str:
    """``crash (killed by signal 9) at 2026-12-05 10:00:00 UTC (run llm, attempt 3)``"""
    what = str(e.detail.get("what") or e.kind.replace("_", " "))
    where = [f"run {e.detail['run']}"] if e.detail.get("run") else []
    if e.attempt is not None:
        where.append(f"attempt {e.attempt}")
    return f"{what} at {_when(e.t)}" + (f" ({', '.join(where)})" if where else "")


def _span(seconds: float) -> str:
    if seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    if seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


def _count(e: Evidence) -> int:
    n = _int(e.detail.get("count"))
    return n if n is not None and n > 0 else 1


def judge(evidence: Sequence[Evidence], *, now: float, cfg: CordonConfig
          ) -> CordonVerdict | None:
    """The cordon the evidence calls for, or None.  ``evidence``: the node's, after its last
    uncordon (the caller leaves the older out); only the last ``cfg.window_s`` seconds of it
    count.  Rules, first that holds: a failed preflight, ECC errors, XID errors,
    infrastructure failures, disk errors, straggler episodes."""
    recent = sorted((e for e in evidence if now - cfg.window_s < e.t), key=lambda e: e.t)
    window = _span(cfg.window_s)

    def of(*kinds: str) -> list[Evidence]:
        return [e for e in recent if e.kind in kinds]

    def verdict(rule: str, what: str, es: list[Evidence]) -> CordonVerdict:
        said = "; ".join(describe(e) for e in es)
        return CordonVerdict(rule, f"{what}: {said}" if what else said,
                             tuple(e.id for e in es))

    failed = of(EvidenceKind.PREFLIGHT_FAILED)
    if cfg.on_failed_preflight and failed:
        return verdict("on_failed_preflight", "", failed[-1:])
    for rule, kind, label in (("ecc_errors", EvidenceKind.ECC, "uncorrected ECC error(s)"),
                              ("xid_errors", EvidenceKind.XID, "XID error(s)")):
        limit: int = getattr(cfg, rule)
        es = of(kind)
        total = sum(_count(e) for e in es)
        if limit and total >= limit:
            return verdict(rule, f"{total} {label} within {window}", es)
    infra = [e for e in of(EvidenceKind.INFRA_FAILURE, EvidenceKind.HANG_CULPRIT)
             if cfg.collective_timeouts
             or e.detail.get("incident_kind") != IncidentKind.COLLECTIVE_TIMEOUT]
    for rule, es, label in (("infra_failures", infra, "infrastructure failures"),
                            (SDC_RULE, of(EvidenceKind.SDC), "silent data corruptions"),
                            ("disk_errors", of(EvidenceKind.DISK_ERROR), "disk errors"),
                            ("stragglers", of(EvidenceKind.STRAGGLER), "straggler episodes")):
        limit = getattr(cfg, rule)
        if limit and len(es) >= limit:
            return verdict(rule, f"{len(es)} {label} within {window}", es)
    return None

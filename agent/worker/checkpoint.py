"""DCP checkpoints a long run can trust.

Layout: ``<root>/step_<N>/`` holds the state after ``N`` steps (resuming from it continues at
step index ``N``).  A save is written into ``<root>/step_<N>.partial/`` and renamed into place by
rank 0 once DCP has written ``.metadata`` (which DCP writes last) and the checkpoint validates,
so a directory named ``step_<N>`` is only ever a finished save.  Completeness is still checked on
load: ``.metadata`` exists, and every shard file it names is present with exactly the size its
items need.  A checkpoint that fails the check is passed over, with a log line saying why.

Only checkpoints inside the Checkpointer's own directory are ever loaded (resolved, symlinks
followed, strictly below it): DCP unpickles ``.metadata``, so a resume plan naming any other
path, or a ``step_<N>`` symlink leading out of the directory, would run someone else's
pickle.  A plan naming one stops the worker with an error saying so.

What is saved: model and optimiser through ``get_state_dict`` (DDP and FSDP2 alike); for every
rank, under a key of its own (DCP keeps one rank's copy of state saved under a shared key:
rank 0 would resume at rank 1's data position), its data-loader position and RNG states;
and, replicated, the seed, the run's configuration, the step, the last loss, the active skip
ranges and LR schedule, which attempt wrote it, and the world sizes (running and declared).

A checkpoint loads on another number of ranks as long as the declared world (which fixes the
global batch) is the same: DCP reshards model and optimiser state (DDP and FSDP2), every rank's
data position is the same next global batch, and a rank the checkpoint holds no state of is
positioned from rank 0's and keeps its seeded RNG (so its random draws, such as dropout, are
not the full-world run's; the data order and batches are).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import socket
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainwarden.agent.protocol import (
    ENV_NODE,
    ENV_RESUME_PLAN,
    PIN_FILE,
    LRSchedule,
    ResumePlan,
    WorkerEventName,
    normalize_ranges,
)
from trainwarden.agent.worker.data import ResumableLoader
from trainwarden.agent.worker.distributed import collect_garbage_at_exit
from trainwarden.agent.worker.elastic import resolve_declared_world_size
from trainwarden.agent.worker.fingerprint import Fingerprints
from trainwarden.agent.worker.report import Reporter, current_attempt, get_reporter, training_done
from trainwarden.agent.worker.save_failure import (
    SaveFailure,
    analyse,
    human_bytes,
    is_save_failure,
)

log = logging.getLogger("trainwarden")

STEP_DIR = re.compile(r"^step_(\d+)$")
PARTIAL_SUFFIX = ".partial"
META_FILE = "trainwarden.json"  # written beside the DCP files, readable without torch
FORMAT_VERSION = 1


@dataclass(frozen=True)
class Validation:
    ok: bool
    reason: str = ""
    nbytes: int = 0


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    path: Path
    complete: bool
    reason: str = ""
    nbytes: int = 0
    pinned: bool = False


def inside(path: str | os.PathLike[str], root: str | os.PathLike[str]) -> bool:
    """Does ``path`` resolve (symlinks followed, ``..`` applied) to a path strictly below
    ``root`` (resolved the same way)?"""
    try:
        p, r = Path(path).resolve(), Path(root).resolve()
    except (OSError, RuntimeError, ValueError):  # a symlink loop, a NUL byte
        return False
    return p != r and p.is_relative_to(r)


def validate_checkpoint(path: str | os.PathLike[str], *, require_meta: bool = True
                        ) -> Validation:
    """Is this DCP directory complete?  ``.metadata`` present and every shard at full size."""
    p = Path(path)
    if not p.is_dir():
        return Validation(False, "not a directory")
    if not (p / ".metadata").is_file():
        return Validation(False, "no .metadata (the save never finished)")
    if require_meta and not (p / META_FILE).is_file():
        return Validation(False, f"no {META_FILE} (not written by trainwarden)")
    try:
        md = dcp.FileSystemReader(str(p)).read_metadata()
    except Exception as e:
        return Validation(False, f"unreadable .metadata: {type(e).__name__}: {e}")
    need: dict[str, int] = {}
    for info in (md.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    if not need:
        return Validation(False, ".metadata names no shard")
    total = (p / ".metadata").stat().st_size
    for rel, size in sorted(need.items()):
        f = p / rel
        if not f.is_file():
            return Validation(False, f"shard {rel} is missing")
        actual = f.stat().st_size
        if actual != size:
            return Validation(False, f"shard {rel} has {actual} bytes, .metadata says {size}")
        total += actual
    return Validation(True, "", total)


def list_checkpoints(root: str | os.PathLike[str], *, validate: bool = True,
                     pattern: re.Pattern[str] = STEP_DIR,
                     validator: Callable[[Path], Validation] | None = None
                     ) -> list[CheckpointInfo]:
    """Checkpoints under ``root``, oldest first (partial save directories are not listed):
    the directories whose name matches ``pattern`` (group 1: the step), each checked by
    ``validator`` (DCP's by default; the framework integrations pass their manifest check).
    One that resolves outside ``root`` (a symlink leading out) is listed as incomplete."""
    out: list[CheckpointInfo] = []
    r = Path(root)
    if not r.is_dir():
        return out
    check = validator or validate_checkpoint
    for child in r.iterdir():
        m = pattern.match(child.name)
        if not m or not child.is_dir():
            continue
        if not inside(child, r):
            v = Validation(False, f"resolves to {child.resolve()}, outside {r.resolve()}")
        else:
            v = check(child) if validate else Validation(True)
        out.append(CheckpointInfo(int(m.group(1)), child, v.ok, v.reason, v.nbytes,
                                  (child / PIN_FILE).exists()))
    out.sort(key=lambda c: c.step)
    return out


def read_meta(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The replicated metadata of a checkpoint (from the file beside the DCP shards)."""
    meta: dict[str, Any] = json.loads((Path(path) / META_FILE).read_text())
    return meta


def load_resume_plan(path: str | None = None) -> ResumePlan | None:
    """The plan named by ``TRAINWARDEN_RESUME_PLAN`` (or ``path``); None when there is none.

    A plan that is named but cannot be read is an error: silently ignoring it would resume
    from the wrong place."""
    path = path if path is not None else os.environ.get(ENV_RESUME_PLAN)
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the resume plan {path}: {e}") from None
    try:
        return ResumePlan.from_json(text)
    except ValueError as e:
        raise ValueError(f"resume plan {path} is invalid: {e}") from None


@dataclass
class ResumeChoice:
    """What rank 0 chose to resume from, as every rank receives it."""

    checkpoint: str | None = None  # the checkpoint to load; None: start fresh
    # The checkpoints passed over on the way to it (incomplete, or not to be loaded: see
    # ``refusal``): (path, why)
    passed_over: list[tuple[str, str]] = field(default_factory=list)
    error: str | None = None  # why nothing may be resumed (every rank raises it)


def share_resume_choice(choice: ResumeChoice | None, *, rank: int, world_size: int,
                        reporter: Reporter, passed_over: list[tuple[Path, str]]) -> str | None:
    """Every rank's copy of rank 0's ``choice`` (collective when distributed; the other ranks
    pass None): the checkpoint to load (None: start fresh); raises ``ValueError`` with the
    error rank 0 found.  The incomplete checkpoints passed over are logged, appended to
    ``passed_over`` and (rank 0) reported."""
    box: list[Any] = [choice if choice is not None else ResumeChoice()]
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    chosen: ResumeChoice = box[0]
    if chosen.error is not None:
        raise ValueError(chosen.error)
    for p, reason in chosen.passed_over:
        passed_over.append((Path(p), reason))
        log.warning("trainwarden: skipping checkpoint %s: %s", p, reason)
        if rank == 0:
            reporter.event(WorkerEventName.CHECKPOINT_SKIPPED,
                           f"checkpoint {p} passed over: {reason}",
                           details={"path": p, "reason": reason})
    return chosen.checkpoint


@dataclass
class _PendingSave:
    step: int
    partial: Path
    final: Path
    started: float
    meta: dict[str, Any]
    future: Future[Any] | None = None
    # How long ``save`` blocked the training loop: waiting on the previous save, the barrier,
    # the state dict and, for an asynchronous save, its staging (set when ``save`` returns;
    # a synchronous save's is taken when it completes, inside ``save``).
    stall_s: float | None = None


@dataclass
class ResumeInfo:
    """What ``Checkpointer.resume`` did."""

    start_step: int
    checkpoint: Path | None = None
    plan: ResumePlan | None = None
    skip: list[tuple[int, int]] = field(default_factory=list)
    lr_schedule: LRSchedule | None = None
    passed_over: list[tuple[Path, str]] = field(default_factory=list)


class Checkpointer:
    """Saves and restores everything a run needs to continue exactly where it was.

    ``interval_s`` saves on wall-clock time (``due()`` agrees across ranks: rank clocks are
    combined with one tiny all-reduce every ``sync_every`` steps); ``every_steps`` saves every
    N steps.  ``keep`` complete checkpoints are retained, plus pinned ones; one that falls out
    of the newest ``keep`` is deleted ``retention_grace_s`` seconds later (at a ``due()`` or
    save after that), so that the supervisor, which sees a loss spike or a crash a second or
    two after it happened, can still pin the last good checkpoint before it even when saves
    come faster than that.  With
    ``async_save`` the write runs in the background on a process group of its own (on the
    default gloo group, with training going on, it aborts with "Received data size doesn't
    match" or hangs to the timeout).
    """

    def __init__(self, root: str | os.PathLike[str], model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, *, loader: ResumableLoader | None = None,
                 interval_s: float | None = None, every_steps: int | None = None,
                 keep: int = 3, async_save: bool = False, seed: int | None = None,
                 config: dict[str, Any] | None = None, sync_every: int = 10,
                 retention_grace_s: float = 30.0, reporter: Reporter | None = None,
                 fingerprints: Fingerprints | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s is not None and interval_s <= 0:
            raise ValueError("interval_s must be > 0 (or None to save on steps only)")
        if every_steps is not None and every_steps <= 0:
            raise ValueError("every_steps must be > 0 (or None to save on time only)")
        if keep < 1:
            raise ValueError("keep must be >= 1: retention never deletes the newest checkpoint")
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        if retention_grace_s < 0:
            raise ValueError("retention_grace_s must be >= 0 (0 deletes at once)")
        collect_garbage_at_exit()  # get_state_dict's cycles would hold the group into shutdown
        self.root = Path(root)
        self.model, self.optimizer, self.loader = model, optimizer, loader
        self.interval_s, self.every_steps, self.keep = interval_s, every_steps, keep
        self.async_save, self.sync_every = async_save, sync_every
        self.retention_grace_s = retention_grace_s
        # Surplus checkpoints (rank 0) and when they fell out of the newest ``keep``.
        self._surplus_since: dict[Path, float] = {}
        self.seed, self.config = seed, dict(config or {})
        self.reporter = reporter or get_reporter()
        self.fingerprints = fingerprints
        self.clock = clock
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.declared_world_size = (loader.order.declared_world_size if loader is not None
                                    else resolve_declared_world_size(self.world_size))
        self.attempt = current_attempt()
        self.last_loss: float | None = None
        self.lr_schedule: LRSchedule | None = None
        self.resumed_from: str | None = None
        self.lineage = f"a{self.attempt}"
        self._last_save = clock()
        self._pending: _PendingSave | None = None
        # Saves failed since the last one that completed (rank 0 counts the completions),
        # and the newest failure.
        self.failed_saves = 0
        self.last_failure: SaveFailure | None = None
        self._group = None
        if async_save and dist.is_initialized():
            self._group = dist.new_group(backend="gloo")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)

    # ---- schedule -----------------------------------------------------------------------
    def due(self, step: int) -> bool:
        """Should ``step`` (steps done) be saved now?  The same answer on every rank."""
        self.poll()
        if self._surplus_since and (min(self._surplus_since.values()) + self.retention_grace_s
                                    <= self.clock()):
            self.apply_retention()
        if self.every_steps and step % self.every_steps == 0:
            return True
        if self.interval_s is None or step % self.sync_every != 0:
            return False
        late = self.clock() - self._last_save >= self.interval_s
        if self.world_size > 1:
            flag = torch.tensor([1 if late else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            late = bool(flag.item())
        return late

    def lr_factor(self, step: int) -> float:
        """LR multiplier for step index ``step`` from the active resume plan (1.0 without)."""
        return self.lr_schedule.factor(step) if self.lr_schedule is not None else 1.0

    # ---- save ---------------------------------------------------------------------------
    def save(self, step: int, *, loss: float | None = None) -> bool:
        """Save the state after ``step`` steps into ``step_<step>``.  Collective: every rank.

        Returns False when the save failed (its disk full, read-only or gone, or anything
        else DCP raised on every rank; see ``save_failure``): training goes on, the partial
        save is removed and the failure reported (``_failed``); the next save tries again.
        An asynchronous save's failure is handled the same way once it is known (``poll``,
        ``wait``)."""
        entered = time.monotonic()
        self.wait()  # one save in flight at a time
        if loss is not None:
            self.last_loss = float(loss)
        final = self.root / f"step_{step}"
        partial = self.root / f"step_{step}{PARTIAL_SUFFIX}"
        if self.rank == 0 and partial.exists():  # left by a process that died mid-save
            shutil.rmtree(partial, ignore_errors=True)
        if self.world_size > 1:
            dist.barrier()  # nobody writes into the partial directory before it is clean
        if self.rank == 0:  # the hang watchdogs allow for the pause a save makes
            self.reporter.event(WorkerEventName.CHECKPOINT_STARTED, f"saving step_{step}",
                                step=step)
        meta = self._meta(step)
        if self.fingerprints is not None:
            meta["replicas"] = self._replicas(step)
        state = self._state_dict(meta)
        pending = _PendingSave(step, partial, final, entered, meta)
        self._last_save = self.clock()
        try:
            if self.async_save:
                response = dcp.async_save(state, checkpoint_id=str(partial),
                                          process_group=self._group)
                # Newer DCP may answer with an AsyncSaveResponse holding the upload future.
                pending.future = getattr(response, "upload_completion", response)  # type: ignore[arg-type]
                pending.stall_s = time.monotonic() - entered
                self._pending = pending
            else:
                dcp.save(state, checkpoint_id=str(partial))
                self._finalize(pending)
        except BaseException as e:
            if not is_save_failure(e):
                raise
            # (A synchronous save's DCP failure reached every rank alike, here, together; an
            # OS error of rank 0's finishing steps is rank 0's alone, and the other ranks went
            # on without it; an asynchronous save's staging is each rank's own.)
            self._failed(pending, e, together=isinstance(e, CheckpointException)
                         and not self.async_save)
            return False
        return True

    def poll(self) -> None:
        """Finish a background save that is done (cheap when nothing is pending)."""
        p = self._pending
        if p is not None and p.future is not None and p.future.done():
            self._pending = None
            self._complete(p)

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete."""
        p = self._pending
        if p is None:
            return
        self._pending = None
        self._complete(p)

    def _complete(self, p: _PendingSave) -> None:
        """A background save's outcome: finalised, or failed (its failure never raised into
        training: DCP's reaches every rank alike, see ``save``)."""
        try:
            if p.future is not None:
                p.future.result()
            self._finalize(p)
        except BaseException as e:
            if not isinstance(e, Exception) and not is_save_failure(e):
                raise  # (KeyboardInterrupt, SystemExit)
            self._failed(p, e)

    def _failed(self, p: _PendingSave, e: BaseException, *, together: bool = False) -> None:
        """A save that failed: remove what it wrote, report it once (from the lowest rank
        that failed, so the node named is one whose disk failed), let retention free what
        it may, and go on training.  The last good checkpoint is never touched.

        ``together``: every rank is here for the same failure (a synchronous save's
        ``CheckpointException``): each reads the room its disk has left, then they meet,
        and only then rank 0 removes the partial save (which still takes that room).  An
        asynchronous save's failure is known to each rank at its own time, so no rank waits
        for another: a rank that reads the room after rank 0's cleanup sees it freed."""
        failure = analyse(e, rank=self.rank, root=self.root)  # room left before the cleanup
        self.failed_saves += 1
        self.last_failure = failure
        if together and self.world_size > 1:
            dist.barrier()
        if self.rank == 0:
            shutil.rmtree(p.partial, ignore_errors=True)
        log.error("trainwarden: %s: checkpoint step_%d not saved (%s); training goes on",
                  failure.what, p.step, failure.error)
        if self.rank == 0:
            self.apply_retention()
        if self.rank != failure.reporter:
            return
        good, _ = self.newest_complete()
        node = os.environ.get(ENV_NODE) or socket.gethostname()
        room = (f"{human_bytes(failure.free_bytes)} free of {human_bytes(failure.total_bytes)}"
                if failure.free_bytes is not None else "free space unknown")
        message = (f"{failure.what} on node {node}: step_{p.step} not saved to {self.root} "
                   f"({failure.error}; {room}); training goes on, the last good checkpoint is "
                   f"{good.name if good else 'none'}")
        self.reporter.event(
            WorkerEventName.CHECKPOINT_FAILED, message, step=p.step,
            details=failure.details(path=str(p.final), root=str(self.root), node=node,
                                    failed_saves=self.failed_saves,
                                    last_good=str(good) if good else None))

    def _finalize(self, p: _PendingSave) -> None:
        if self.rank != 0:
            self.failed_saves = 0  # (its part of the save is done; rank 0 finishes it)
            return
        v = validate_checkpoint(p.partial, require_meta=False)
        if not v.ok:
            self._failed(p, RuntimeError(f"saved checkpoint does not validate: {v.reason}"))
            return
        p.meta["files"] = file_checksums(p.partial)
        (p.partial / META_FILE).write_text(json.dumps(p.meta, indent=1))
        if p.final.exists():  # a step redone after a rollback: the new branch replaces it
            shutil.rmtree(p.final)
        os.replace(p.partial, p.final)
        fsync_dir(self.root)
        save_s = time.monotonic() - p.started
        stall_s = p.stall_s if p.stall_s is not None else save_s  # (synchronous: all of it)
        log.info("trainwarden: checkpoint step_%d complete (%d bytes, %.2fs)", p.step, v.nbytes,
                 save_s)
        self.reporter.checkpoint(step=p.step, path=str(p.final.resolve()), nbytes=v.nbytes,
                                 save_s=save_s, async_save=self.async_save,
                                 lineage=self.lineage, stall_s=stall_s)
        self.failed_saves = 0
        self.apply_retention()

    def _meta(self, step: int) -> dict[str, Any]:
        skip = [list(r) for r in self.loader.skip] if self.loader is not None else []
        lr = self.lr_schedule
        return {
            "format": FORMAT_VERSION, "step": step, "loss": self.last_loss, "seed": self.seed,
            "config": self.config, "time": time.time(), "attempt": self.attempt,
            "lineage": self.lineage, "resumed_from": self.resumed_from,
            "world_size": self.world_size, "declared_world_size": self.declared_world_size,
            "skip": skip,
            "lr_schedule": None if lr is None else {
                "scale": lr.scale, "steps": lr.steps, "ramp_steps": lr.ramp_steps,
                "start_step": lr.start_step},
        }

    def _replicas(self, step: int) -> dict[str, Any]:
        """The replicas' agreement on the state saved (a fingerprint check of this step,
        collective): a checkpoint saved at or after their first disagreement is marked
        ``agree: false`` and never loaded."""
        fp = self.fingerprints
        assert fp is not None
        v = fp.check(step)
        agree = None if v is None else (v.agree and not fp.disagreed)
        return {"agree": agree, "step": step,
                "fingerprints": None if v is None else v.details()["fingerprints"],
                "first_disagreement": fp.first_disagreement}

    def _state_dict(self, meta: dict[str, Any]) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        rank_state = {"rng": rng_state(),
                      "data": self.loader.state_dict() if self.loader is not None else None}
        return {"model": msd, "optim": osd, "trainwarden/meta": json.dumps(meta),
                f"trainwarden/rank{self.rank}": json.dumps(rank_state)}

    # ---- retention ----------------------------------------------------------------------
    def apply_retention(self) -> list[Path]:
        """Keep the newest ``keep`` complete checkpoints plus pinned ones, and the surplus ones
        until their grace is over; rank 0 only.  Returns what was deleted."""
        if self.rank != 0:
            return []
        now = self.clock()
        cps = list_checkpoints(self.root)
        complete = [c for c in cps if c.complete]
        keep = {c.path for c in complete[-self.keep:]} | {c.path for c in cps if c.pinned}
        surplus = {c.path for c in complete if c.path not in keep}
        self._surplus_since = {p: self._surplus_since.get(p, now) for p in surplus}
        removed = []
        for path, since in list(self._surplus_since.items()):
            if now - since >= self.retention_grace_s:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                del self._surplus_since[path]
        in_flight = self._pending.partial if self._pending else None
        for child in self.root.glob(f"step_*{PARTIAL_SUFFIX}"):
            if child != in_flight:  # a save that died with its process
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        return removed

    def pin(self, step: int, reason: str = "") -> None:
        """Never delete ``step_<step>`` by retention."""
        (self.root / f"step_{step}" / PIN_FILE).write_text(reason + "\n")

    def unpin(self, step: int) -> None:
        (self.root / f"step_{step}" / PIN_FILE).unlink(missing_ok=True)

    # ---- load / resume ------------------------------------------------------------------
    def newest_complete(self, *, verify: bool = False
                        ) -> tuple[Path | None, list[tuple[Path, str]]]:
        """The newest complete checkpoint, and the newer ones passed over with the reason.
        ``verify``: also pass over those that are not to be loaded (``refusal``: a file
        whose checksum is not the one recorded, replicas that disagreed)."""
        passed: list[tuple[Path, str]] = []
        for c in reversed(list_checkpoints(self.root)):
            why = c.reason if not c.complete else (refusal(c.path) if verify else None)
            if why is None:
                return c.path, passed
            passed.append((c.path, why))
        return None, passed

    def _outside(self, path: str | os.PathLike[str]) -> str | None:
        """Why ``path`` may not be loaded (it is not inside this Checkpointer's directory), or
        None when it may."""
        if inside(path, self.root):
            return None
        return (f"checkpoint {path} is not inside this run's checkpoint directory "
                f"{self.root.resolve()}: the worker loads only its own checkpoints")

    def _complete_at_or_before(self, named: str, passed: list[tuple[str, str]]
                               ) -> Path | None:
        """The newest complete checkpoint before the one named that may be loaded; those
        passed over on the way are appended to ``passed``."""
        m = STEP_DIR.match(Path(named).name)
        if m is None:
            return None
        limit = int(m.group(1))
        for c in reversed(list_checkpoints(Path(named).resolve().parent)):
            if c.step < limit and c.complete:
                why = refusal(c.path)
                if why is None:
                    return c.path
                passed.append((str(c.path), why))
        return None

    def load(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore model, optimiser, this rank's data position and RNG; returns the metadata.

        Raises ``ValueError`` for a path outside this Checkpointer's directory."""
        refused = self._outside(path)
        if refused is not None:
            raise ValueError(refused)
        self._check_declared_world(path, read_meta(path))
        msd, osd = get_state_dict(self.model, self.optimizer)
        rank_key = self._rank_key_in(path)
        state: dict[str, Any] = {"model": msd, "optim": osd, "trainwarden/meta": "",
                                 rank_key: ""}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        meta: dict[str, Any] = json.loads(state["trainwarden/meta"])
        rank_state = json.loads(state[rank_key])
        if rank_key == f"trainwarden/rank{self.rank}":
            set_rng_state(rank_state["rng"])
        if self.loader is not None and rank_state.get("data") is not None:
            self.loader.load_state_dict(rank_state["data"])
        self.last_loss = meta.get("loss")
        return meta

    def _check_declared_world(self, path: str | os.PathLike[str], meta: dict[str, Any]) -> None:
        """Refuse a checkpoint of another global batch; any number of ranks is fine.  One
        written before the declared world was recorded ran on its full world."""
        saved = meta.get("declared_world_size", meta.get("world_size", self.declared_world_size))
        if saved != self.declared_world_size:
            raise ValueError(
                f"checkpoint {path} was written by a run declaring {saved} ranks (a global "
                f"batch of {saved} micro-batches), this run declares {self.declared_world_size}:"
                f" resuming would change the global batch; resume with "
                f"TRAINWARDEN_DECLARED_WORLD_SIZE={saved} (on any number of ranks up to it)")

    def _rank_key_in(self, path: str | os.PathLike[str]) -> str:
        """This rank's key in the checkpoint, or rank 0's when the checkpoint was written by
        fewer ranks (growing back): every rank holds the same next global batch, and the
        caller restores RNG states only from a rank's own key."""
        own = f"trainwarden/rank{self.rank}"
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        if own in keys or self.rank == 0:
            return own
        log.info("trainwarden: checkpoint %s holds no state of rank %d: data position from "
                 "rank 0's, RNG states left as seeded", path, self.rank)
        return "trainwarden/rank0"

    def resume(self, plan: ResumePlan | str | None = "env") -> ResumeInfo:
        """Restore the run as the resume plan says; returns where to continue.

        ``plan="env"`` reads the plan named by ``TRAINWARDEN_RESUME_PLAN`` (none: resume from
        the newest complete checkpoint, or start fresh).  Rank 0 chooses the checkpoint and
        every rank loads that one.  Skip ranges from the checkpoint and the plan are merged;
        the plan's LR schedule starts at the resumed step, else a schedule saved in the
        checkpoint continues where it was.
        """
        if plan == "env":
            plan = load_resume_plan()
        assert plan is None or isinstance(plan, ResumePlan)
        info = ResumeInfo(start_step=0, plan=plan)
        chosen: ResumeChoice | None = None
        if self.rank == 0:
            refused = self._outside(plan.checkpoint) if plan is not None and plan.checkpoint \
                else None
            if refused is not None:
                chosen = ResumeChoice(error=f"resume plan refused: {refused}")
            elif plan is not None and plan.checkpoint:
                v = validate_checkpoint(plan.checkpoint)
                why = v.reason if not v.ok else refusal(plan.checkpoint)
                if why is None:
                    chosen = ResumeChoice(str(plan.checkpoint))
                else:
                    # Gone (pruned before the pin arrived), damaged or not to be trusted: roll
                    # back further, to the newest complete checkpoint before it, never forward
                    # past it.
                    skipped: list[tuple[str, str]] = [(str(plan.checkpoint), why)]
                    older = self._complete_at_or_before(plan.checkpoint, skipped)
                    if older is None:
                        chosen = ResumeChoice(error=(
                            f"resume plan names checkpoint {plan.checkpoint}, which is not "
                            f"{'complete' if not v.ok else 'to be loaded'} ({why}), and no "
                            "complete checkpoint precedes it that may be"))
                    else:
                        chosen = ResumeChoice(str(older), skipped)
            else:
                path, passed = self.newest_complete(verify=True)
                chosen = ResumeChoice(str(path) if path else None,
                                      [(str(p), r) for p, r in passed])
        target = share_resume_choice(chosen, rank=self.rank, world_size=self.world_size,
                                     reporter=self.reporter, passed_over=info.passed_over)
        meta: dict[str, Any] = {}
        if target is not None:
            meta = self.load(target)
            info.checkpoint = Path(target)
            info.start_step = int(meta["step"])
            self.resumed_from = str(target)
        skips = normalize_ranges([list(r) for r in meta.get("skip", [])] +
                                 [list(r) for r in (plan.skip if plan else ())])
        if self.loader is not None:
            self.loader.add_skips(skips)
            position = self.loader.position
            for a, b in (plan.skip if plan else ()):
                if a < position:
                    log.warning("trainwarden: skip range [%d, %d] starts before the resumed "
                                "data position %d; batches before it were already trained",
                                a, b, position)
        elif skips:
            raise ValueError("the resume plan skips batches but the Checkpointer has no "
                             "loader: pass loader=ResumableLoader(...)")
        info.skip = skips
        if plan is not None and plan.lr is not None:
            self.lr_schedule = LRSchedule(plan.lr.scale, plan.lr.steps, plan.lr.ramp_steps,
                                          start_step=info.start_step)
        elif meta.get("lr_schedule"):
            s = meta["lr_schedule"]
            saved = LRSchedule(s["scale"], s["steps"], s["ramp_steps"], start_step=s["start_step"])
            self.lr_schedule = saved if saved.end_step() > info.start_step else None
        info.lr_schedule = self.lr_schedule
        if plan is not None and plan.lineage:
            self.lineage = plan.lineage
        self._last_save = self.clock()
        if self.rank == 0:
            details = {"checkpoint": str(info.checkpoint) if info.checkpoint else None,
                       "step": info.start_step, "skip": [list(r) for r in skips],
                       "lr_schedule": meta_lr(self.lr_schedule),
                       "action_id": plan.action_id if plan else None,
                       "reason": plan.reason if plan else ""}
            self.reporter.event(WorkerEventName.RESUMED, f"resumed at step {info.start_step} from "
                                f"{info.checkpoint or 'scratch'}", step=info.start_step,
                                details=details)
            if skips:
                self.reporter.event(WorkerEventName.BATCHES_SKIPPED, f"will skip batches {skips}",
                                    step=info.start_step,
                                    details={"skip": [list(r) for r in skips]})
        log.info("trainwarden: resuming at step %d from %s", info.start_step,
                 info.checkpoint or "scratch")
        return info

    def close(self) -> None:
        """Finish the save in flight and report the training loop done (``training_done``):
        call it after the loop, before the final evaluation and the process's exit."""
        self.wait()
        training_done(reporter=self.reporter)


CHECKSUM_CHUNK = 1 << 20  # bytes read at a time when a checkpoint's files are hashed


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHECKSUM_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_checksums(directory: Path) -> dict[str, str]:
    """The SHA-256 of every file DCP wrote in a checkpoint directory (its shards and
    ``.metadata``), by name: recorded with the checkpoint, verified before it is loaded."""
    return {f.name: file_sha256(f) for f in sorted(directory.iterdir())
            if f.is_file() and f.name != META_FILE and f.name != PIN_FILE}


def refusal(path: str | os.PathLike[str]) -> str | None:
    """Why a complete checkpoint must not be loaded, or None: a file whose SHA-256 is not the
    one recorded when it was saved (corrupted on disk), or a save made after the data-parallel
    replicas' fingerprints disagreed (silent data corruption: the state may be corrupt).
    A checkpoint that recorded neither (an older format) is loaded as before."""
    p = Path(path)
    try:
        meta = read_meta(p)
    except (OSError, ValueError) as e:
        return f"unreadable {META_FILE}: {e}"
    replicas = meta.get("replicas") or {}
    if replicas.get("agree") is False:
        first = replicas.get("first_disagreement")
        return (f"saved at step {meta.get('step')}, after the data-parallel replicas' "
                f"parameter fingerprints disagreed (step {first}): silent data corruption "
                "suspected, never loaded")
    for name, digest in sorted((meta.get("files") or {}).items()):
        f = p / name
        try:
            actual = file_sha256(f)
        except OSError as e:
            return f"file {f} cannot be read: {e}"
        if actual != digest:
            return (f"file {f} is corrupted: its SHA-256 is {actual[:16]}..., "
                    f"{digest[:16]}... was recorded when it was saved")
    return None


def meta_lr(s: LRSchedule | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {"scale": s.scale, "steps": s.steps, "ramp_steps": s.ramp_steps,
            "start_step": s.start_step}


def rng_state() -> dict[str, Any]:
    """Every random generator a training step may draw from (torch, CUDA, NumPy, Python), as
    JSON-able lists: saved per rank beside each checkpoint, so a resume draws exactly what an
    uninterrupted run would have (the framework callbacks save it the same way)."""
    np_state: Any = np.random.get_state()
    py_state = random.getstate()
    return {
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()]
        if torch.cuda.is_available() else None,
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }


def set_rng_state(s: dict[str, Any]) -> None:
    """Restore what ``rng_state`` saved."""
    torch.set_rng_state(torch.tensor(s["torch"], dtype=torch.uint8))
    if s.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(x, dtype=torch.uint8) for x in s["cuda"]])
    n = s["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    p = s["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


def fsync_dir(path: Path) -> None:
    """Make a directory's new entries durable (a checkpoint's files renamed into place must
    survive a crash of the node); a file system that cannot says nothing."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass

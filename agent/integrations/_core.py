"""What the framework callbacks share: the resume plan applied, the step -> global batch map,
checkpoint manifests (completeness), retention that honours pins, the LR plan on the optimiser,
and the per-step report.

A framework writes its own checkpoint files (a Hugging Face ``checkpoint-N/`` directory, a
Lightning ``step_N/`` directory); trainwarden adds, in the same directory, one
``trainwarden-rank<R>.json`` per rank (its RNG states) and, last, after every rank has finished
writing, ``trainwarden.json``: the replicated metadata (step, data position, skip ranges, LR
schedule, lineage, attempt, seed, configuration) and a manifest naming every file of the
checkpoint with its size.  A directory counts as a complete checkpoint only when
``trainwarden.json`` exists and every file it names is there with exactly that size, so a save
that died half-way is never resumed from (it is passed over with a log line).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainwarden.agent.protocol import (
    PIN_FILE,
    LRSchedule,
    ResumePlan,
    WorkerEventName,
    normalize_ranges,
)
from trainwarden.agent.worker.checkpoint import (
    FORMAT_VERSION,
    META_FILE,
    CheckpointInfo,
    ResumeChoice,
    Validation,
    fsync_dir,
    list_checkpoints,
    load_resume_plan,
    meta_lr,
    rng_state,
    set_rng_state,
    share_resume_choice,
)
from trainwarden.agent.worker.distributed import collect_garbage_at_exit
from trainwarden.agent.worker.elastic import resolve_declared_world_size
from trainwarden.agent.worker.report import (
    PhaseTimer,
    Reporter,
    current_attempt,
    get_reporter,
    report_step,
)

log = logging.getLogger("trainwarden")

RANK_FILE = "trainwarden-rank{rank}.json"
_NOT_IN_MANIFEST = {META_FILE, PIN_FILE}


# ---- the data order --------------------------------------------------------------------------
def accumulation_for(steps: int, *, world_size: int, declared: int) -> int:
    """Gradient accumulation steps that keep the declared world's global batch on
    ``world_size`` ranks: ``steps x declared / world_size``.  A framework runs the same number
    of micro-batches on every rank, so that must be a whole number; ValueError otherwise."""
    if steps < 1:
        raise ValueError(f"gradient accumulation steps must be >= 1, got {steps}")
    total = steps * declared
    if total % world_size:
        raise ValueError(
            f"a global batch of {declared} ranks x {steps} accumulation steps = {total} "
            f"micro-batches cannot be shared evenly by the {world_size} ranks running: restart "
            f"on a number of ranks that divides {total}, or on the full world")
    return total // world_size


def batch_index_at(step: int, *, start_step: int, position: int,
                   skip: Iterable[tuple[int, int]]) -> int:
    """Global batch index trained at ``step``: the ``step - start_step``-th index from
    ``position`` on that no skip range holds (``position`` is trained at ``start_step``)."""
    if step < start_step:
        raise ValueError(f"step {step} is before the resumed step {start_step}")
    g, n = position, step - start_step
    for a, b in sorted(skip):
        if b < g:
            continue
        if g + n < a:
            break
        n -= max(0, a - g)
        g = b + 1
    return g + n


# ---- checkpoint manifests --------------------------------------------------------------------
def write_manifest(path: Path, meta: dict[str, Any]) -> int:
    """Write ``trainwarden.json`` (meta + every file's size) into ``path``, atomically, last.
    Returns the checkpoint's size in bytes."""
    files: dict[str, int] = {}
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path).as_posix()
        if f.is_file() and rel not in _NOT_IN_MANIFEST and not rel.startswith(f"{META_FILE}."):
            files[rel] = f.stat().st_size
    if not files:
        raise RuntimeError(f"checkpoint {path} holds no file")
    tmp = path / f"{META_FILE}.tmp{os.getpid()}"
    tmp.write_text(json.dumps({**meta, "files": files}, indent=1))
    os.replace(tmp, path / META_FILE)
    fsync_dir(path)
    return sum(files.values())


def validate_manifest(path: str | os.PathLike[str]) -> Validation:
    """Is this framework checkpoint complete?  Its manifest is there, every file at full size."""
    p = Path(path)
    if not p.is_dir():
        return Validation(False, "not a directory")
    if not (p / META_FILE).is_file():
        return Validation(False, f"no {META_FILE} (the save never finished)")
    try:
        files = json.loads((p / META_FILE).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return Validation(False, f"unreadable {META_FILE}: {type(e).__name__}: {e}")
    total = 0
    for rel, size in sorted(files.items()):
        f = p / rel
        if not f.is_file():
            return Validation(False, f"file {rel} is missing")
        if f.stat().st_size != size:
            return Validation(False, f"file {rel} has {f.stat().st_size} bytes, "
                                     f"{META_FILE} says {size}")
        total += size
    return Validation(True, "", total)


def list_step_checkpoints(root: str | os.PathLike[str], pattern: re.Pattern[str]
                          ) -> list[CheckpointInfo]:
    """Directories under ``root`` whose name matches ``pattern`` (group 1: the step), oldest
    first, each validated against its manifest (``Checkpointer``'s listing, with this check)."""
    return list_checkpoints(root, pattern=pattern, validator=validate_manifest)


# ---- retention -------------------------------------------------------------------------------
class Retention:
    """Deletes checkpoints only once they have been surplus for ``grace_s`` seconds and are not
    pinned (a ``PINNED`` file: the supervisor protects them), the rule
    ``Checkpointer.apply_retention`` keeps for hand-written loops.  What is surplus is the
    caller's: the oldest beyond the newest ``keep`` (Hugging Face), or what a Lightning
    ``ModelCheckpoint`` asked to remove."""

    def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if grace_s < 0:
            raise ValueError("retention_grace_s must be >= 0 (0 deletes at once)")
        self.grace_s = grace_s
        self.clock = clock
        self.since: dict[Path, float] = {}

    def pending(self) -> bool:
        return bool(self.since) and min(self.since.values()) + self.grace_s <= self.clock()

    def apply(self, surplus: Iterable[Path], *, add: bool = False) -> list[Path]:
        """``surplus``: what may go (``add``: on top of what was surplus before).  Deletes what
        has been surplus for the grace and is not pinned now; returns what it deleted."""
        now = self.clock()
        new = set(surplus)
        if add:
            new |= set(self.since)
        self.since = {p: self.since.get(p, now) for p in new if p.exists()}
        removed = []
        for path, since in list(self.since.items()):
            if (path / PIN_FILE).exists():
                continue  # protected: kept, and reconsidered once the pin is lifted
            if now - since >= self.grace_s:
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
                del self.since[path]
                log.info("trainwarden: retention deleted %s", path)
        return removed


def newest_surplus(cps: list[CheckpointInfo], keep: int, also_keep: Iterable[Path] = ()
                   ) -> set[Path]:
    """Complete checkpoints beyond the newest ``keep`` (pinned ones stay, and ``also_keep``)."""
    complete = [c for c in cps if c.complete]
    kept = {c.path for c in complete[-keep:]} | {c.path for c in cps if c.pinned}
    kept |= {Path(p) for p in also_keep}
    return {c.path for c in complete if c.path not in kept}


# ---- the run -------------------------------------------------------------------------------
@dataclass
class Resumed:
    """Where this start of the script continues."""

    start_step: int = 0
    position: int = 0  # the global batch index trained at start_step
    checkpoint: Path | None = None
    skip: list[tuple[int, int]] = field(default_factory=list)
    passed_over: list[tuple[Path, str]] = field(default_factory=list)


class RunSession:
    """One start of a training script under trainwarden, framework-independent.

    ``resume()`` chooses the checkpoint (the plan's, else the newest complete one; rank 0
    decides, every rank gets the same), reads its metadata, merges the skip ranges and starts
    the LR schedule.  ``batch_index(step)`` is the data order from there on.  ``save_due()``
    decides time-based saves the same way on every rank.  ``finish_checkpoint()`` is the
    collective end of a save: per-rank RNG files, a barrier, the manifest, the report to the
    agent, retention.
    """

    def __init__(self, *, seed: int | None, keep: int, retention_grace_s: float,
                 save_every_s: float | None, sync_every: int, config: dict[str, Any] | None,
                 reporter: Reporter | None, clock: Callable[[], float]) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1: retention never deletes the newest checkpoint")
        if save_every_s is not None and save_every_s <= 0:
            raise ValueError("save_every_s must be > 0 (or None to save on the framework's "
                             "step schedule only)")
        if sync_every < 1:
            raise ValueError("sync_every must be >= 1")
        collect_garbage_at_exit()
        self.seed, self.keep = seed, keep
        self.retention = Retention(retention_grace_s, clock)
        self.save_every_s, self.sync_every = save_every_s, sync_every
        self.config = dict(config or {})
        self._reporter = reporter
        self.clock = clock
        self.attempt = current_attempt()
        self.lineage = f"a{self.attempt}"
        self.plan: ResumePlan | None = None
        self.resumed = Resumed()
        self.lr_schedule: LRSchedule | None = None
        self.skipped: list[tuple[int, int]] = []  # ranges the data order passed over
        self._rng_to_restore: dict[str, Any] | None = None
        self._last_save = clock()
        self._save_started: float | None = None
        self.last_loss: float | None = None

    # ---- identity ---------------------------------------------------------------------------
    @property
    def reporter(self) -> Reporter:
        return self._reporter or get_reporter()

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    @property
    def declared_world_size(self) -> int:
        """The run's full world (``TRAINWARDEN_DECLARED_WORLD_SIZE``, else the world size)."""
        return resolve_declared_world_size(self.world_size)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    # ---- resume -----------------------------------------------------------------------------
    def resume(self, root: Path, pattern: re.Pattern[str]) -> Resumed:
        """Apply the plan named by ``TRAINWARDEN_RESUME_PLAN`` (or resume from the newest
        complete checkpoint under ``root``).  Collective when distributed."""
        plan = self.plan = load_resume_plan()
        chosen = _choose(root, pattern, plan) if self.rank == 0 else None
        r = self.resumed = Resumed()
        target = share_resume_choice(chosen, rank=self.rank, world_size=self.world_size,
                                     reporter=self.reporter, passed_over=r.passed_over)
        meta: dict[str, Any] = {}
        if target is not None:
            path = Path(target)
            meta = json.loads((path / META_FILE).read_text())
            declared = self.declared_world_size
            saved = meta.get("declared_world_size", meta.get("world_size", declared))
            if saved != declared:
                raise ValueError(
                    f"checkpoint {path} was written by a run declaring {saved} ranks, this run "
                    f"declares {declared}: resuming would change the global batch; resume "
                    f"with TRAINWARDEN_DECLARED_WORLD_SIZE={saved} (on any number of ranks up "
                    "to it)")
            if self.seed is not None and meta.get("seed") not in (None, self.seed):
                raise ValueError(f"checkpoint {path} was written with seed={meta['seed']} but "
                                 f"this run has seed={self.seed}: resume with the same seed "
                                 "(the batch order depends on it)")
            rank_file = path / RANK_FILE.format(rank=self.rank)
            if rank_file.is_file():
                self._rng_to_restore = json.loads(rank_file.read_text())["rng"]
            else:  # written by fewer ranks (the run grows back): the seeded RNG goes on
                log.info("trainwarden: checkpoint %s holds no state of rank %d: RNG states "
                         "left as seeded", path, self.rank)
            r.checkpoint, r.start_step, r.position = path, int(meta["step"]), int(meta["position"])
            self.last_loss = meta.get("loss")
        r.skip = normalize_ranges([list(x) for x in meta.get("skip", [])] +
                                  [list(x) for x in (plan.skip if plan else ())])
        for a, b in (plan.skip if plan else ()):
            if a < r.position:
                log.warning("trainwarden: skip range [%d, %d] starts before the resumed data "
                            "position %d; batches before it were already trained", a, b,
                            r.position)
        self.skipped = [tuple(x) for x in meta.get("skipped", [])]
        if plan is not None and plan.lr is not None:
            self.lr_schedule = LRSchedule(plan.lr.scale, plan.lr.steps, plan.lr.ramp_steps,
                                          start_step=r.start_step)
        elif meta.get("lr_schedule"):
            s = meta["lr_schedule"]
            saved = LRSchedule(s["scale"], s["steps"], s["ramp_steps"], start_step=s["start_step"])
            self.lr_schedule = saved if saved.end_step() > r.start_step else None
        if plan is not None and plan.lineage:
            self.lineage = plan.lineage
        self._last_save = self.clock()
        if self.rank == 0:
            details = {"checkpoint": str(r.checkpoint) if r.checkpoint else None,
                       "step": r.start_step, "skip": [list(x) for x in r.skip],
                       "lr_schedule": meta_lr(self.lr_schedule),
                       "action_id": plan.action_id if plan else None,
                       "reason": plan.reason if plan else ""}
            self.reporter.event(WorkerEventName.RESUMED, f"resumed at step {r.start_step} from "
                                f"{r.checkpoint or 'scratch'}", step=r.start_step,
                                details=details)
            if r.skip:
                self.reporter.event(WorkerEventName.BATCHES_SKIPPED, f"will skip batches {r.skip}",
                                    step=r.start_step,
                                    details={"skip": [list(x) for x in r.skip]})
        log.info("trainwarden: resuming at step %d from %s", r.start_step,
                 r.checkpoint or "scratch")
        return r

    def restore_rng(self) -> None:
        """Put back this rank's RNG states as they were when the checkpoint was saved.  Called
        right before the first resumed step, after everything the framework does on start
        (its own RNG restore, a DataLoader iterator drawing its base seed), so nothing drawn
        between the restore and the step shifts the random streams (dropout)."""
        if self._rng_to_restore is not None:
            set_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    # ---- per step ---------------------------------------------------------------------------
    def batch_index(self, step: int) -> int:
        r = self.resumed
        return batch_index_at(step, start_step=r.start_step, position=r.position, skip=r.skip)

    def lr_factor(self, step: int) -> float:
        return self.lr_schedule.factor(step) if self.lr_schedule is not None else 1.0

    def trained(self, step: int, index: int) -> None:
        """Record that ``step`` trained global batch ``index`` (the skips it passed over)."""
        previous = self.batch_index(step - 1) if step > self.resumed.start_step else (
            self.resumed.position - 1)
        if index > previous + 1:
            a, b = previous + 1, index - 1
            self.skipped.append((a, b))
            log.warning("trainwarden: skipped global batches %d-%d (rank %d)", a, b, self.rank)

    def save_due(self, step: int) -> bool:
        """Time-based saving (``save_every_s``): the same answer on every rank."""
        if self.save_every_s is None or step % self.sync_every != 0:
            return False
        late = self.clock() - self._last_save >= self.save_every_s
        if self.world_size > 1:
            flag = torch.tensor([1 if late else 0], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            late = bool(flag.item())
        return late

    # ---- checkpoints ------------------------------------------------------------------------
    def save_starting(self, step: int, path: Path) -> None:
        """A save of the state after ``step`` steps into ``path`` begins (every rank).  A
        directory of the same name from an abandoned branch or an earlier attempt is removed
        first, so no old file can pass for part of the new checkpoint."""
        self._save_started = time.monotonic()
        self._last_save = self.clock()
        if self.rank == 0:
            self.reporter.event(WorkerEventName.CHECKPOINT_STARTED, f"saving {path.name}",
                                step=step)
            if path.exists():
                shutil.rmtree(path)
        self.barrier()

    def finish_checkpoint(self, step: int, path: Path, *, protect: Iterable[Path] = (),
                          surplus: Callable[[], Iterable[Path]] | None = None) -> None:
        """Collective, after the framework wrote ``path``: every rank adds its RNG file, then
        rank 0 writes the manifest, reports the checkpoint and applies retention."""
        position = self.batch_index(step) if step >= self.resumed.start_step else 0
        (path / RANK_FILE.format(rank=self.rank)).write_text(
            json.dumps({"rng": rng_state(), "position": position}))
        self.barrier()
        if self.rank != 0:
            return
        meta = {"format": FORMAT_VERSION, "step": step, "position": position,
                "loss": self.last_loss, "seed": self.seed, "config": self.config,
                "time": time.time(), "attempt": self.attempt, "lineage": self.lineage,
                "resumed_from": str(self.resumed.checkpoint) if self.resumed.checkpoint else None,
                "world_size": self.world_size,
                "declared_world_size": self.declared_world_size,
                "skip": [list(x) for x in self.resumed.skip],
                "skipped": [list(x) for x in self.skipped],
                "lr_schedule": meta_lr(self.lr_schedule)}
        nbytes = write_manifest(path, meta)
        started = self._save_started or time.monotonic()
        save_s = time.monotonic() - started
        log.info("trainwarden: checkpoint %s complete (%d bytes, %.2fs)", path, nbytes, save_s)
        self.reporter.checkpoint(step=step, path=str(path.resolve()), nbytes=nbytes,
                                 save_s=save_s, async_save=False, lineage=self.lineage,
                                 stall_s=save_s)
        if surplus is not None:
            self.retention.apply(surplus())


def _choose(root: Path, pattern: re.Pattern[str], plan: ResumePlan | None) -> ResumeChoice:
    """What to resume from under ``root`` (the rule ``Checkpointer.resume`` follows for DCP
    checkpoints)."""
    if plan is not None and plan.checkpoint:
        named = Path(plan.checkpoint)
        v = validate_manifest(named)
        if v.ok:
            return ResumeChoice(str(named))
        m = pattern.match(named.name)
        older = None
        if m is not None:  # gone or damaged: roll back further, never forward past it
            for c in reversed(list_step_checkpoints(named.parent, pattern)):
                if c.step <= int(m.group(1)) and c.complete:
                    older = c.path
                    break
        if older is None:
            return ResumeChoice(error=f"resume plan names checkpoint {named}, which is not "
                                      f"complete ({v.reason}), and no complete checkpoint "
                                      "precedes it")
        return ResumeChoice(str(older), [(str(named), v.reason)])
    passed: list[tuple[str, str]] = []
    for c in reversed(list_step_checkpoints(root, pattern)):
        if c.complete:
            return ResumeChoice(str(c.path), passed)
        passed.append((str(c.path), c.reason))
    return ResumeChoice(None, passed)


# ---- the optimiser --------------------------------------------------------------------------
def innermost_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimiser inside a framework's wrapper (accelerate, Lightning)."""
    seen = 0  # accelerate's AcceleratedOptimizer subclasses Optimizer and wraps the real one
    while hasattr(opt, "optimizer") and seen < 5:
        opt, seen = opt.optimizer, seen + 1
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"not a torch optimizer: {type(opt).__name__}")
    return opt


class OptimizerPlan:
    """The plan's LR factor on top of the framework's scheduler, and the step's grad norm.

    A step pre-hook multiplies each group's LR by the factor and a post-hook puts the
    scheduler's value back right after ``optimizer.step()``, so the scheduler (chainable or
    not) never sees the factor; the LR the step trained with is kept for the report."""

    def __init__(self, session: RunSession, step: Callable[[], int],
                 grad_norm: bool = True) -> None:
        self.session, self.step, self.want_grad_norm = session, step, grad_norm
        self.lr: float | None = None
        self.grad_norm: float | None = None
        self._saved: list[float] = []
        self._handles: list[Any] = []
        self.optimizer: torch.optim.Optimizer | None = None

    def attach(self, optimizer: Any) -> None:
        opt = innermost_optimizer(optimizer)
        if opt is self.optimizer:
            return
        self.detach()
        self.optimizer = opt
        self._handles = [opt.register_step_pre_hook(self._pre),
                         opt.register_step_post_hook(self._post)]

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self.optimizer = None

    def _pre(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        factor = self.session.lr_factor(self.step())
        self._saved = [g["lr"] for g in opt.param_groups]
        if factor != 1.0:
            for g in opt.param_groups:
                g["lr"] = g["lr"] * factor
        self.lr = float(opt.param_groups[0]["lr"])
        if self.want_grad_norm:
            self.grad_norm = _grad_norm(opt)

    def _post(self, opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        for g, lr in zip(opt.param_groups, self._saved, strict=False):
            g["lr"] = lr


def _grad_norm(opt: torch.optim.Optimizer) -> float | None:
    grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads)
    if hasattr(norm, "full_tensor"):  # sharded gradients (FSDP2): every rank takes part
        norm = norm.full_tensor()
    return float(norm)


def attach_grad_timer(model: torch.nn.Module, timer: PhaseTimer) -> list[Any]:
    """``timer.compute_done()`` each time a parameter's gradient is accumulated: the last one
    of a step marks the end of this rank's backward compute, before it waits on its peers'
    gradients (a framework builds its DDP wrapper itself, so no comm hook is at hand)."""
    # (torch leaves register_post_accumulate_grad_hook unannotated)
    return [p.register_post_accumulate_grad_hook(  # type: ignore[no-untyped-call]
                lambda _p: timer.compute_done())
            for p in model.parameters() if p.requires_grad]


@dataclass
class StepRecord:
    """What one step trained, for the report and for scripts that log it."""

    step: int
    batch_index: int
    lr: float | None
    loss: float | None = None


def report(session: RunSession, rec: StepRecord, *, samples: int | None, tokens: int | None,
           grad_norm: float | None, timer: PhaseTimer) -> None:
    report_step(rec.step, loss=rec.loss, samples=samples, tokens=tokens, lr=rec.lr,
                grad_norm=grad_norm, timer=timer, batch_index=rec.batch_index)

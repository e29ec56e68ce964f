"""The in-training API: a few calls a training script adds to become supervisable.

Importable without the supervisor's dependencies (no FastAPI, SQLAlchemy or HTTP client).

    info = init_distributed(timeout=60)
    loader = ResumableLoader(dataset, batch_size=32, rank=info.rank,
                             world_size=info.world_size, seed=args.seed)
    ckpt = Checkpointer(args.checkpoint_dir, model, optimizer, loader=loader, interval_s=300)
    start = resume(ckpt)                       # reads TRAINWARDEN_RESUME_PLAN when set
    batches = iter(loader)
    for step in range(start, args.steps):
        batch = next(batches)                  # batch.index is the global batch index
        for g in optimizer.param_groups:
            g["lr"] = base_lr * ckpt.lr_factor(step)
        for part in batch.parts(model):        # one part, weight 1.0, on the full world
            loss = loss_fn(model(part.data))
            part.weighted(loss).backward()     # gradient sync on the last part only
        optimizer.step()
        ...
        report_step(step, loss=loss_value, samples=n, lr=lr, timer=timer)
        if ckpt.due(step + 1):
            ckpt.save(step + 1, loss=loss_value)
    ckpt.close()
"""

from trainwarden.agent.protocol import LRSchedule, ResumePlan
from trainwarden.agent.worker.checkpoint import (
    Checkpointer,
    CheckpointInfo,
    ResumeInfo,
    list_checkpoints,
    load_resume_plan,
    read_meta,
    validate_checkpoint,
)
from trainwarden.agent.worker.data import Batch, GlobalBatchOrder, ResumableLoader
from trainwarden.agent.worker.distributed import DistInfo, attach_compute_timer, init_distributed
from trainwarden.agent.worker.elastic import Part, gradient_sync, resolve_declared_world_size
from trainwarden.agent.worker.fingerprint import Fingerprints
from trainwarden.agent.worker.preflight import PreflightFailed, PreflightResult
from trainwarden.agent.worker.report import (
    PhaseTimer,
    Reporter,
    declare_flops,
    get_reporter,
    report_event,
    report_step,
    training_done,
)


def resume(checkpointer: Checkpointer, plan: ResumePlan | str | None = "env") -> int:
    """Restore everything the resume plan asks for; returns the step index to continue from."""
    return checkpointer.resume(plan).start_step


__all__ = [
    "Batch",
    "CheckpointInfo",
    "Checkpointer",
    "DistInfo",
    "Fingerprints",
    "GlobalBatchOrder",
    "LRSchedule",
    "Part",
    "PhaseTimer",
    "PreflightFailed",
    "PreflightResult",
    "Reporter",
    "ResumableLoader",
    "ResumeInfo",
    "ResumePlan",
    "attach_compute_timer",
    "declare_flops",
    "get_reporter",
    "gradient_sync",
    "init_distributed",
    "list_checkpoints",
    "load_resume_plan",
    "read_meta",
    "report_event",
    "report_step",
    "resolve_declared_world_size",
    "resume",
    "training_done",
    "validate_checkpoint",
]

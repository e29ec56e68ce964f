"""Process-group start-up that survives restarts, and failure reporting on the way out."""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType

import torch
import torch.distributed as dist

from trainwarden.agent.protocol import WorkerEventName
from trainwarden.agent.worker.elastic import resolve_declared_world_size
from trainwarden.agent.worker.preflight import PreflightFailed, preflight_at_start
from trainwarden.agent.worker.report import PhaseTimer, current_attempt, get_reporter

# Python stacks of every thread go to stderr on this signal (the agent sends it to a hung
# worker before killing it, and reads the stacks from the worker's output).
STACK_DUMP_SIGNAL = signal.SIGUSR1

_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "reduce",
    "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list", "barrier",
    "monitored_barrier", "all_to_all", "all_to_all_single", "gather", "gather_object",
    "scatter", "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
}


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int  # ranks running now
    local_rank: int
    backend: str
    device: torch.device
    attempt: int
    # The run's full world, which fixes the global batch (``TRAINWARDEN_DECLARED_WORLD_SIZE``,
    # else ``world_size``); more than ``world_size`` while the run is on fewer ranks.
    declared_world_size: int


def init_distributed(timeout: float | timedelta = 300.0, backend: str | None = None) -> DistInfo:
    """Start the default process group with an explicit collective timeout.

    Works on every torchrun attempt: torchrun's store keeps the addresses of the previous
    attempt's workers, and gloo then connects to dead peers ("Gloo connectFullMesh failed ...
    Connection refused" on 9 of 10 restarts with the default rendezvous).  We
    rendezvous ourselves and prefix the store with the attempt, so each attempt meets only its
    own peers.  Without torchrun (no WORLD_SIZE) this starts a one-process group.

    A collective timeout or other distributed error that ends the process is reported to the
    agent (rank, collective, message) before the process exits non-zero.

    Once per process, before returning, every rank runs the preflight health check
    (``trainwarden.agent.worker.preflight``: its device, a checked matmul, a timed
    all-reduce across the new group) and reports it; a failed check raises
    ``PreflightFailed``, so the worker exits before its first step.
    ``TRAINWARDEN_PREFLIGHT=0`` turns it off.

    ``TRAINWARDEN_DECLARED_WORLD_SIZE`` (the run's full world, when it runs on fewer ranks)
    becomes ``DistInfo.declared_world_size``; a value that is not a positive integer, or is
    below the world size, raises ``ValueError`` (reported to the agent like any exception that
    ends a worker).
    """
    if isinstance(timeout, int | float):
        timeout = timedelta(seconds=float(timeout))
    if timeout <= timedelta(0):
        raise ValueError("init_distributed(timeout=...) must be positive")
    use_cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if use_cuda else "gloo")
    attempt = current_attempt()
    if "WORLD_SIZE" in os.environ:
        store, rank, world_size = next(dist.rendezvous("env://"))
        restarts = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"trainwarden/attempt_{attempt}_{restarts}/", store)
    else:
        store, rank, world_size = dist.HashStore(), 0, 1
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if use_cuda and backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timeout)
    install_failure_reporting()
    collect_garbage_at_exit()
    reporter = get_reporter()
    reporter.set_identity(rank, world_size)
    declared = resolve_declared_world_size(world_size)  # a bad value is reported, then raised
    reporter.event(WorkerEventName.STARTED, f"rank {rank}/{world_size} started",
                   details={"backend": backend, "timeout_s": timeout.total_seconds(),
                            "local_rank": local_rank, "declared_world_size": declared})
    global _preflight_ran
    if not _preflight_ran:
        _preflight_ran = True
        preflight_at_start(local_rank=local_rank, group_timeout=timeout, reporter=reporter)
    return DistInfo(rank, world_size, local_rank, backend, device, attempt, declared)


# The preflight checks the gang this process first joins; a script that starts a group again
# in the same process is not checked twice.
_preflight_ran = False


_backend_cleanup_registered = False


def collect_garbage_at_exit() -> None:
    """Collect garbage at exit, while the interpreter is still whole.

    torch's state-dict helpers (DCP's ``get_state_dict``) leave reference cycles that hold the
    model, and through DDP the process group with its gloo threads, past the end of ``main()``
    and past ``destroy_process_group()``.  Freed by the garbage collector during interpreter
    shutdown instead, a gloo thread releasing its last all-reduce's tensors needs the GIL,
    Python ends that thread with ``pthread_exit`` because it is finalizing, and the forced
    unwind through C++ aborts the finished worker ("terminate called without an active
    exception", exit -6; core dumps show that stack).  An ``atexit`` collection frees the
    group first, while its threads can still finish and be joined.  Registered once, by
    ``init_distributed`` and by the ``Checkpointer`` (whose state-dict calls make the cycles,
    also under a process group started elsewhere).
    """
    global _backend_cleanup_registered
    if not _backend_cleanup_registered:
        _backend_cleanup_registered = True
        atexit.register(gc.collect)


def install_failure_reporting() -> None:
    """Report an uncaught exception to the agent before the default hook prints it."""
    # Not on every platform, and only from the main thread.
    with contextlib.suppress(AttributeError, ValueError, RuntimeError):
        faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True, chain=False)
    previous = sys.excepthook
    if getattr(previous, "_trainwarden", False):
        return

    def hook(exc_type: type[BaseException], exc: BaseException,
             tb: TracebackType | None) -> None:
        try:
            report_exception(exc)
        finally:
            previous(exc_type, exc, tb)

    # (a mark on the function object: the hook is installed once)
    hook._trainwarden = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def classify_exception(exc: BaseException) -> tuple[str, str]:
    """(event name, collective) for an exception that is about to end a worker."""
    if isinstance(exc, PreflightFailed):
        # Its own event said which check failed; its words ("all-reduce", "bound") must not
        # read as a collective timeout of the training.
        return WorkerEventName.EXCEPTION, "unknown"
    msg = str(exc)
    low = msg.lower()
    collective = collective_from_traceback(exc.__traceback__) or _collective_from_message(low)
    dist_error = isinstance(exc, dist.DistError) or any(
        s in low for s in ("gloo", "nccl", "connection reset by peer", "connection closed by peer",
                           "process group", "c10d"))
    if ("timed out" in low or "timeout" in low) and (dist_error or collective != "unknown"):
        return WorkerEventName.COLLECTIVE_TIMEOUT, collective
    if dist_error:
        return WorkerEventName.DISTRIBUTED_ERROR, collective
    return WorkerEventName.EXCEPTION, collective


def collective_from_traceback(tb: TracebackType | None) -> str | None:
    """The innermost torch.distributed collective (or DDP's backward sync) in a traceback."""
    found: str | None = None
    saw_backward = False
    for frame, _ in traceback.walk_tb(tb):
        name = frame.f_code.co_name
        fname = frame.f_code.co_filename
        if "torch/distributed" in fname and name in _COLLECTIVES:
            found = name
        if name in ("backward", "_engine_run_backward"):
            saw_backward = True
    if found is None and saw_backward:
        return "all_reduce (gradient sync in backward)"
    return found


def _collective_from_message(low: str) -> str:
    for op in ("recv", "send", "allreduce", "allgather", "broadcast", "barrier"):
        if f"{op} operation" in low or f" {op}" in low:
            return op
    return "unknown"


def report_exception(exc: BaseException) -> None:
    """Send the event for an exception that ends this worker; waits briefly, never raises."""
    try:
        name, collective = classify_exception(exc)
        reporter = get_reporter()
        reporter.event(
            name, f"{type(exc).__name__}: {exc}".strip(),
            details={"collective": collective, "exception": type(exc).__name__,
                     "rank": reporter.rank},
            blocking=True,
        )
    except Exception:
        pass


def attach_compute_timer(model: torch.nn.Module, timer: PhaseTimer,
                         process_group: dist.ProcessGroup | None = None) -> None:
    """Mark ``timer.compute_done()`` where this rank's own compute ends and its wait on the
    others begins.

    - DDP: each time a gradient bucket is handed to the all-reduce (a comm hook that then runs
      DDP's default all-reduce).  The last bucket of a step is ready when this rank's backward
      compute is finished, so ``compute_s`` is the work before the wait on the slowest peer
      (in synchronous training every rank's wall step time is the same; this part is not).
    - FSDP2 (``fully_shard``): at the end of the root module's forward pass.  FSDP gathers the
      parameters inside forward, so there ``compute_s`` is the forward pass, all-gathers
      included: a coarser split than DDP's.

    Any other module raises ``TypeError``: call ``timer.compute_done()`` yourself after the
    part of the step that is this rank's own work.
    """
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.register_forward_hook(lambda _m, _args, _out: timer.compute_done())
        return
    if not hasattr(model, "register_comm_hook"):
        raise TypeError(
            f"attach_compute_timer needs a DistributedDataParallel or fully_shard (FSDP2) "
            f"model, not {type(model).__name__}: call timer.compute_done() yourself where "
            "this rank's own compute ends (before the first blocking collective)")
    import torch.distributed.algorithms.ddp_comm_hooks.default_hooks as default_hooks

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects string annotations
        timer.compute_done()
        return default_hooks.allreduce_hook(state, bucket)

    # (DDP's register_comm_hook, which FSDP's type does not declare; checked above)
    model.register_comm_hook(process_group or dist.group.WORLD, hook)  # type: ignore[operator]

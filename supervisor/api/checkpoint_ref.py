"""How an operator names a checkpoint (restart, rollback): by the id the store gave it or by
its step, never by a path.  A path is what an agent reported; one an operator types would
reach every agent's resume plan unchecked."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, status

from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import CheckpointRow

NOT_A_PATH = ('a checkpoint is named by its id ("checkpoint": ID, as GET '
              '/api/v1/runs/RUN/checkpoints lists them) or by its step ("step": N), never by a '
              'path')
_PATH_KEYS = ("path", "checkpoint_path")


def checkpoint_id(v: Any) -> Any:
    """A ``checkpoint`` field's value before validation: a path (any text that is not a
    number) is refused saying how to name it instead."""
    if isinstance(v, str) and not v.strip().isdigit():
        raise ValueError(f"{v[:200]!r} is not a checkpoint id: {NOT_A_PATH}")
    return v


def no_path(data: Any) -> Any:
    """A request body before validation: a ``path`` key is refused the same way."""
    if isinstance(data, dict) and any(k in data for k in _PATH_KEYS):
        raise ValueError(NOT_A_PATH)
    return data


def known_checkpoint(conn: Connection, *, run_id: int, run: str, checkpoint_id: int | None,
                     step: int | None) -> CheckpointRow:
    """The checkpoint named by id or step: it exists (404), is complete and on the current
    lineage (422)."""
    ck = rec.checkpoint_by(conn, run_id=run_id, checkpoint_id=checkpoint_id, step=step)
    what = (f"checkpoint {checkpoint_id}" if checkpoint_id is not None
            else f"checkpoint at step {step}")
    if ck is None:
        raise HTTPException(status.HTTP_404_NOT_FOUND, f"run {run!r} has no {what}")
    if not ck["complete"]:
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT,
                            f"checkpoint {ck['id']} (step {ck['step']}) is not complete")
    if ck["abandoned"]:
        raise HTTPException(
            status.HTTP_422_UNPROCESSABLE_CONTENT,
            f"checkpoint {ck['id']} (step {ck['step']}) is on a branch an earlier "
            "rollback abandoned; pick one of the current lineage (GET .../checkpoints)")
    return ck

"""The operator's rollback: back to a named checkpoint, skipping batch ranges, with the LR
lowered for a while; and the progress of any action."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Path, Request, status
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field, field_validator, model_validator

from trainwarden.agent.protocol import LRSchedule, normalize_ranges
from trainwarden.supervisor.api.checkpoint_ref import checkpoint_id, known_checkpoint, no_path
from trainwarden.supervisor.api.deps import (
    DB,
    ClockDep,
    OperatorAuth,
    ReadAuth,
    Settings,
    can_read,
)
from trainwarden.supervisor.api.errors import ERROR_RESPONSES
from trainwarden.supervisor.api.responses import ActionRecord, RollbackAccepted, documented
from trainwarden.supervisor.contract.limits import U31, U63, RunName, Text, text
from trainwarden.supervisor.control import actions, policy
from trainwarden.supervisor.enums import FINAL_STATUSES
from trainwarden.supervisor.observability import efficiency
from trainwarden.supervisor.store import reads, registry

router = APIRouter(tags=["recovery"], responses=ERROR_RESPONSES)


class RollbackRequest(BaseModel):
    """Exactly one of ``checkpoint`` (a checkpoint id, as listed by ``/checkpoints``) or
    ``step`` names where to roll back to (never a path)."""

    checkpoint: U31 | None = Field(default=None, description="checkpoint id")
    step: U31 | None = Field(default=None, description="or the checkpoint's step")
    skip: list[Annotated[list[U63], Field(min_length=2, max_length=2)]] = Field(
        default_factory=list, max_length=1000,
        description="inclusive global batch-index ranges [from, to] to skip")
    lr_scale: float = Field(default=1.0, gt=0.0, le=10.0, description="LR multiplier")
    lr_scale_steps: int = Field(default=0, ge=0, le=10_000_000,
                                description="steps at lr_scale, from the resumed step")
    lr_ramp_steps: int = Field(default=0, ge=0, le=10_000_000,
                               description="then linearly back to 1.0 over this many steps")
    reason: Text = text(max_length=1000)

    model_config = {"extra": "forbid"}

    _no_path = model_validator(mode="before")(no_path)
    _checkpoint_id = field_validator("checkpoint", mode="before")(checkpoint_id)

    @field_validator("skip")
    @classmethod
    def _ranges(cls, v: list[list[int]]) -> list[list[int]]:
        return [list(r) for r in normalize_ranges(v)]  # ValueError names the bad range

    @model_validator(mode="after")
    def _one_target(self) -> RollbackRequest:
        if (self.checkpoint is None) == (self.step is None):
            raise ValueError('give exactly one of "checkpoint" (an id) or "step"')
        if self.lr_scale != 1.0 and self.lr_scale_steps == 0 and self.lr_ramp_steps == 0:
            raise ValueError("lr_scale needs lr_scale_steps (and optionally lr_ramp_steps): "
                             "for how many steps should the LR be scaled?")
        return self


@router.post("/runs/{run}/rollback", response_model=None, status_code=202,
             responses=documented(RollbackAccepted, 202))
def rollback(run: RunName, req: RollbackRequest, db: DB, clock: ClockDep, auth: OperatorAuth,
             settings: Settings) -> JSONResponse:
    """Gang-restart the run from the named checkpoint with a resume plan (skip ranges, LR
    schedule).  Validated first (the checkpoint exists, is complete, belongs to this run and
    to its current lineage); nothing is stored when it is refused."""
    auth.require_run(run)
    now = clock()
    with db.write() as conn:
        r = registry.get_run_by_name(conn, name=run)
        if r is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown run {run!r}")
        if r["status"] in FINAL_STATUSES:
            raise HTTPException(status.HTTP_409_CONFLICT,
                                f"run {run!r} is {r['status']}: nothing to roll back")
        ck = known_checkpoint(conn, run_id=r["id"], run=run, checkpoint_id=req.checkpoint,
                              step=req.step)
        lr = None
        if req.lr_scale != 1.0:
            lr = LRSchedule(scale=req.lr_scale, steps=req.lr_scale_steps,
                            ramp_steps=req.lr_ramp_steps)
        decision = policy.operator_rollback(
            actions.facts(r), checkpoint=ck["path"], step=int(ck["step"]),
            skip=tuple((int(a), int(b)) for a, b in req.skip), lr=lr,
            reason=req.reason or f"operator rollback to step {ck['step']}",
            actor=auth.actor, now=now)
        if isinstance(decision, policy.Note):
            raise HTTPException(status.HTTP_409_CONFLICT, f"nothing done: {decision.why}")
        action_id = actions.apply(conn, run=r, decision=decision, now=now,
                                  live_s=settings.node_lost.deadline_s)
    return JSONResponse({"run": run, "action_id": action_id, "checkpoint": ck["id"],
                         "step": ck["step"]}, status_code=202)


@router.get("/actions/{action_id}", response_model=None, responses=documented(ActionRecord))
def get_action(action_id: Annotated[U31, Path()], db: DB, request: Request,
               auth: ReadAuth) -> dict[str, Any]:
    """One action with its progress: queued, delivered, restarted, resumed (first step),
    and for a restart its ``anatomy``: the milestones' times and the seconds of each phase
    (stop_workers, launch, rendezvous, load_checkpoint, first_step; null where a milestone
    is not recorded, never 0 for unknown), their ``total_s`` and ``notes``."""
    with db.read() as conn:
        a = reads.get_action(conn, action_id=action_id)
        if a is not None and not can_read(
                request, auth, str(registry.get_run(conn, run_id=a["run_id"])["name"])):
            a = None  # another scope's action: as if there were none
        if a is None:
            raise HTTPException(status.HTTP_404_NOT_FOUND, f"unknown action {action_id}")
        (out,) = efficiency.with_anatomy(conn, [a])
        return out

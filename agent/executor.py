"""Apply supervisor commands, each exactly once, as small non-blocking state machines.

The supervisor re-sends a command in every ingest reply until a ``command_result`` for it
arrives, so the same command is seen many times; the set of applied command ids is persisted
(``commands.json``) so an agent restart does not apply one twice either.  A command that an
earlier incarnation accepted but did not finish (it died mid-restart) is applied again, unless
the relaunch it asked for already happened (the persisted attempt shows it).

``tick`` advances the current command a step without blocking: the stop of the worker tree
takes up to the grace period and the relaunch may wait for ``not_before``, and meanwhile the
main loop must keep draining the worker socket and sending heartbeats.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, Protocol

from trainwarden.agent import protocol
from trainwarden.agent.core.states import CommandStatus
from trainwarden.agent.statefile import load_json, save_json

log = logging.getLogger(__name__)

# A finished command the supervisor keeps re-sending (our result is still spooled, or was
# dropped) gets its final result again, but at most this often.
_RESEND_RESULT_S = 5.0


class Host(Protocol):
    """What the executor needs from the agent."""

    @property
    def attempt(self) -> int: ...

    def begin_stop(self, *, immediate: bool = False) -> None: ...

    def collect_stacks(self, reason: str, command_id: int | None) -> None: ...

    def pin_checkpoint(self, path: str, reason: str) -> None: ...

    def stopped(self) -> bool: ...

    def launch(self, attempt: int, plan_path: Path | None) -> None: ...

    def place(self, plan: protocol.ResumePlan | None) -> str | None: ...

    def stand_by(self, attempt: int, reason: str) -> None: ...

    def finish(self, end: object) -> None: ...


@dataclasses.dataclass
class _Job:
    command: protocol.Command
    phase: Literal["stopping", "waiting", "launching"]
    plan: protocol.ResumePlan | None = None


class Executor:
    def __init__(self, state_dir: Path, host: Host, emit: Callable[[dict[str, Any]], None],
                 clock: Callable[[], float] = time.time) -> None:
        self.host = host
        self.emit = emit
        self.clock = clock
        self.path = state_dir / "commands.json"
        self.plan_dir = state_dir / "plans"
        self.queue: collections.deque[protocol.Command] = collections.deque()
        self.job: _Job | None = None
        self._last_result: dict[int, float] = {}
        self.seen: dict[int, dict[str, Any]] = {}
        raw = load_json(self.path)
        self.seen = {int(k): v for k, v in raw.items() if isinstance(v, dict) and k.isdigit()}
        # Accepted by an earlier incarnation but not finished: decide now whether it is done.
        for rec in self.seen.values():
            if rec.get("status") == CommandStatus.DELIVERED:
                if rec.get("kind") == protocol.COMMAND_RESTART and isinstance(
                    rec.get("attempt"), int
                ) and host.attempt >= rec["attempt"]:
                    rec.update(status=CommandStatus.DONE, detail="relaunched by the previous agent",
                               reported=False)
                else:
                    rec["status"] = "interrupted"  # apply again when it is re-sent
        self._save()

    @property
    def busy(self) -> bool:
        return self.job is not None or bool(self.queue)

    def _save(self) -> None:
        save_json(self.path, {str(k): v for k, v in self.seen.items()})

    def _result(self, cid: int, status: CommandStatus, detail: str = "") -> None:
        rec = self.seen.setdefault(cid, {})
        rec.update(status=status, detail=detail)
        self._save()
        self._last_result[cid] = self.clock()
        self.emit({"type": "command_result", "t": self.clock(), "command_id": cid,
                   "status": status, "detail": detail})
        log.info("command %d: %s %s", cid, status, detail)

    # -- intake ------------------------------------------------------------------------------

    def submit(self, commands: list[protocol.Command]) -> None:
        for cmd in commands:
            cid = cmd.get("id")
            if not isinstance(cid, int) or isinstance(cid, bool):
                log.error("command without an integer id ignored: %r", cmd)
                continue
            rec = self.seen.get(cid)
            if rec is not None and rec.get("status") != "interrupted":
                self._maybe_resend(cid, rec)
                continue
            kind = cmd.get("kind")
            self.seen[cid] = {"status": CommandStatus.DELIVERED, "kind": kind,
                              "attempt": cmd.get("attempt"), "detail": ""}
            self._result(cid, CommandStatus.DELIVERED)
            if kind not in (protocol.COMMAND_RESTART, protocol.COMMAND_STOP):
                self._result(cid, CommandStatus.FAILED, f"unknown command kind {kind!r}")
                continue
            self.queue.append(cmd)

    def _maybe_resend(self, cid: int, rec: dict[str, Any]) -> None:
        """The supervisor still waits for our result: say it again, rate-limited."""
        if rec.get("status") not in (CommandStatus.DONE, CommandStatus.FAILED):
            return  # in progress: the final result follows when it is reached
        last = self._last_result.get(cid)
        if last is None or self.clock() - last >= _RESEND_RESULT_S:
            self._result(cid, rec["status"], rec.get("detail", ""))

    # -- progress ----------------------------------------------------------------------------

    def tick(self) -> None:
        # A stop overrides a restart that is only waiting for its not_before.
        if (self.job is not None and self.job.phase == "waiting"
                and any(c.get("kind") == protocol.COMMAND_STOP for c in self.queue)):
            cid = int(self.job.command["id"])
            self._result(cid, CommandStatus.FAILED, "superseded by a stop command")
            self.job = None
        if self.job is None:
            if not self.queue:
                return
            self._begin(self.queue.popleft())
        if self.job is not None:
            self._advance(self.job)

    def _begin(self, cmd: protocol.Command) -> None:
        cid = int(cmd["id"])
        plan = None
        if cmd.get("kind") == protocol.COMMAND_RESTART:
            attempt = cmd.get("attempt")
            if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 0:
                self._result(cid, CommandStatus.FAILED, f"restart needs an integer attempt >= 0, "
                                            f"got {attempt!r}")
                return
            try:
                raw = cmd.get("plan")
                plan = (protocol.ResumePlan.from_dict(raw) if raw is not None
                        else protocol.ResumePlan(reason=str(cmd.get("reason", ""))))
            except (ValueError, TypeError) as e:
                self._result(cid, CommandStatus.FAILED, f"invalid resume plan: {e}")
                return
            if plan.attempt is None:
                plan = dataclasses.replace(plan, attempt=attempt)
        if plan is not None and plan.checkpoint:
            # The workers may still be saving (and pruning) while we stop them: the
            # checkpoint this restart resumes from must survive their retention.
            self.host.pin_checkpoint(plan.checkpoint, f"resume target of command {cid}")
        if cmd.get("collect_stacks"):
            # A hung run: read every worker's stacks first, then kill the tree at once.
            self.host.collect_stacks(str(cmd.get("reason", "")), cid)
            self.host.begin_stop(immediate=True)
        else:
            self.host.begin_stop()
        self.job = _Job(command=cmd, phase="stopping", plan=plan)

    def _advance(self, job: _Job) -> None:
        cmd = job.command
        cid = int(cmd["id"])
        if job.phase == "stopping":
            if not self.host.stopped():
                return
            if cmd.get("kind") == protocol.COMMAND_STOP:
                self.job = None
                self._result(cid, CommandStatus.DONE, "workers stopped")
                plan = cmd.get("plan")
                self.host.finish(plan.get("run_status") if isinstance(plan, dict) else None)
                return
            job.phase = "waiting"
        if job.phase == "waiting":
            not_before = cmd.get("not_before")
            if isinstance(not_before, int | float) and self.clock() < not_before:
                return
            job.phase = "launching"
        attempt = int(cmd["attempt"])
        why = self.host.place(job.plan)
        if why is not None:  # the membership says this node runs nothing for this attempt
            self.job = None
            self.host.stand_by(attempt, why)
            self._result(cid, CommandStatus.DONE, why)
            return
        try:
            plan_path = self._write_plan(attempt, job.plan)
            self.host.launch(attempt, plan_path)
        except Exception as e:  # OSError, a missing executable...: report, do not die
            self.job = None
            log.exception("restart %d failed to launch", cid)
            self._result(cid, CommandStatus.FAILED, f"launch failed: {type(e).__name__}: {e}")
            return
        self.job = None
        self._result(cid, CommandStatus.DONE, f"relaunched as attempt {attempt}")

    def _write_plan(self, attempt: int, plan: protocol.ResumePlan | None) -> Path | None:
        if plan is None:
            return None
        self.plan_dir.mkdir(parents=True, exist_ok=True)
        path = self.plan_dir / f"attempt-{attempt}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(plan.to_json())
        os.replace(tmp, path)  # the workers never read a half-written plan
        return path

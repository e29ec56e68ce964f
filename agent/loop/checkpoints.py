"""Checkpoints: the roots learned from the workers' reports, the pins a restart and the
supervisor's protection set."""

from __future__ import annotations

import logging
from typing import Any

from trainwarden.agent import protocol
from trainwarden.agent.core.states import NodeRole
from trainwarden.agent.loop.base import AgentBase

log = logging.getLogger("trainwarden.agent.loop")


class CheckpointsMixin(AgentBase):
    """The checkpoints the agent learns of and pins."""

    def _learn_checkpoint(self, msg: dict[str, Any]) -> None:
        learned, registered = self.roots.learn(msg.get("path"))
        if not learned:
            return
        self.pins.roots = self.roots.pin_roots()
        self._save_state()
        if registered:
            # The supervisor refuses a checkpoint outside the roots this agent registered:
            # register again (before the batch carrying this checkpoint goes out).
            self.uplink.update_registration(self._register_request())

    def _report_refused_pins(self) -> None:
        for path, why in self.pins.take_refused():
            self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                        "name": protocol.AgentEventName.PIN_REFUSED,
                        "message": f"refused to pin {path!r}: {why}",
                        "details": {"path": path, "reason": why,
                                    "refused": self.pins.refused}})

    def pin_checkpoint(self, path: str, reason: str) -> None:
        """Mark the checkpoint a restart resumes from so the workers' retention keeps it
        (``PINNED``, honoured by ``trainwarden.agent.worker.Checkpointer``); the pin this agent set
        for an
        earlier restart is lifted, so pins do not pile up."""
        if self.pins.set("restart", [path], reason):
            self._save_state()
        self._report_refused_pins()

    def _apply_protection(self) -> None:
        """Pin what the supervisor's latest reply says to protect (and only that).  A spare
        runs no workers, whose retention the pins are for: it pins nothing."""
        want = self.uplink.protect
        if want is None or self.role == NodeRole.SPARE:
            return  # no reply yet (or an older supervisor): leave the pins as they are
        if self.pins.set("protect", want, "protected by the supervisor (last good checkpoint "
                                          "or the target of a pending restart)"):
            self._save_state()
        self._report_refused_pins()

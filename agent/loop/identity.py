"""Which run the local state belongs to: registration before any worker starts, a state of
another run archived and replaced, a registration answered only after the launch."""

from __future__ import annotations

import logging
import os
import time

from trainwarden.agent import protocol
from trainwarden.agent.loop.membership import MembershipMixin

log = logging.getLogger("trainwarden.agent.loop")


class IdentityMixin(MembershipMixin):
    """The run's identity: the local state must be the registered run's."""

    def _identify(self) -> None:
        """Register before any worker starts: the reply names the run (its uuid and attempt)
        the local state must belong to.  A state of another run is archived here."""
        reply = self.uplink.register_now(self.cfg.register_wait_s)
        if self.uplink.refused:
            self._refused()
        elif reply is None:
            self._launched_unregistered = True
            log.warning("the supervisor did not accept the registration within %.0f s: "
                        "launching attempt %d from the local state (run uuid %s); it is "
                        "checked once the supervisor answers", self.cfg.register_wait_s,
                        self._attempt, self.run_uuid or "none yet")
        elif self.uplink.foreign is not None:
            self._archive_state(reply)
        else:
            self._adopt(reply, launching=True)
            self._learn_registration(reply)

    def _adopt(self, reply: protocol.RegisterReply, *, launching: bool) -> None:
        """Record the run's uuid in the state; a new state launched now starts at the run's
        attempt (a node joining a run that has restarted, a state just archived)."""
        uuid = reply.get("run_uuid")
        if not uuid or uuid == self.run_uuid:
            return
        if launching and self._unbound:
            self._attempt, self.plan_path = int(reply.get("attempt") or 0), None
        self.run_uuid, self._unbound = uuid, False
        self._save_state()

    def _archive_state(self, reply: protocol.RegisterReply) -> None:
        """The local state is another run's (a reused run name: another uuid, or a state
        saved before runs had one): move it aside, open a fresh one, and take the run's
        uuid and attempt.  Called with no worker running and the sender thread stopped."""
        self.uplink.close()  # its sender thread writes in the state dir
        old = self.run_uuid
        tag = old or f"no-uuid-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}"
        dest = self.state_dir.with_name(f"{self.state_dir.name}.archived-{tag}")
        n = 1
        while dest.exists():
            n += 1
            dest = dest.with_name(f"{self.state_dir.name}.archived-{tag}-{n}")
        dest.mkdir(parents=True)
        keep = {"agent.lock", self.cfg.socket_path.name}
        for child in list(self.state_dir.iterdir()):
            if child.name not in keep:
                os.replace(child, dest / child.name)
        self.archived = dest
        log.warning(
            "the state in %s belongs to another run named %r (run uuid %s; the supervisor's "
            "run is %s, at attempt %s): archived it to %s and starting afresh, so no worker "
            "starts at its attempt or resumes from its checkpoints", self.state_dir,
            self.cfg.run, old or "none recorded", reply.get("run_uuid"), reply.get("attempt"),
            dest)
        self._open_state()
        self.uplink.adopt_credential(reply)  # the node is ours: the new state proves it
        self._adopt(reply, launching=True)
        self._registered_attempt_checked = False
        self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                    "name": protocol.AgentEventName.STATE_ARCHIVED,
                    "message": f"local agent state of another run (uuid {old or 'none'}) "
                               f"archived to {dest}",
                    "details": {"archived_to": str(dest), "old_run_uuid": old}})

    def _check_registration(self) -> None:
        if self.uplink.refused and self.result is None:
            self._refused()  # shutdown() stops the workers
            return
        if self.uplink.foreign is not None:
            self._replace_foreign_state(self.uplink.foreign)
            return
        reg = self.uplink.registration
        if reg is not None and reg.get("run_uuid") not in (None, self.run_uuid):
            self._adopt(reg, launching=False)
        reg = self.uplink.registration
        if reg is None or self._registered_attempt_checked:
            return
        self._registered_attempt_checked = True
        if self._launched_unregistered:
            self._launched_unregistered = False
            self._learn_registration(reg)
            self._realign_membership()
        # Training was launched before registering (it never waits on the supervisor), so it
        # runs the attempt this node last knew; say so when the supervisor knows better.
        if reg.get("attempt") not in (None, self._attempt):
            log.warning("supervisor says the run is at attempt %s, local workers run attempt "
                        "%d: the supervisor's next restart command realigns them",
                        reg.get("attempt"), self._attempt)

    def _replace_foreign_state(self, reply: protocol.RegisterReply) -> None:
        """The supervisor answered only after the workers were launched from the local state,
        and that state is another run's: stop them, archive it, relaunch as the run's
        attempt on a fresh state (what they reported meanwhile is dropped)."""
        log.error("the workers were launched from the state of another run named %r "
                  "(uuid %s, not %s): stopping them to start afresh", self.cfg.run,
                  self.run_uuid or "none", reply.get("run_uuid"))
        self.launcher.stop()
        self.receiver.drain()
        self.receiver.take()
        self.pending = []
        self._archive_state(reply)
        self.launch(self._attempt, self.plan_path)
        if self.threaded_uplink:
            self.uplink.start()

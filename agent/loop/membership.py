"""What the node is in its run, as the supervisor decides it: the membership a registration
or a restart's plan gives, standing by as a spare, no longer a member, woken from a stop
past the node-lost deadline, relaunched for the membership decided after torchrun started."""

from __future__ import annotations

import logging
from typing import Any

from trainwarden.agent import protocol
from trainwarden.agent.core.launch import Membership, rewrite
from trainwarden.agent.core.states import AgentState, NodeRole
from trainwarden.agent.loop.base import AgentBase

log = logging.getLogger("trainwarden.agent.loop")


class MembershipMixin(AgentBase):
    """The node's role and membership in its run."""

    def _learn_registration(self, reply: protocol.RegisterReply) -> None:
        """What the registration reply says this node is."""
        lost = reply.get("node_lost_s")
        if isinstance(lost, int | float) and lost > 0:
            self.node_lost_s = float(lost)
        view = reply.get("membership")
        if not isinstance(view, dict):
            return  # an older supervisor: the command runs as it is
        self.role = NodeRole(view.get("role") or NodeRole.MEMBER)
        rank, nnodes, ep = view.get("node_rank"), view.get("nnodes"), view.get("endpoint")
        if (self.role == NodeRole.MEMBER and isinstance(rank, int) and isinstance(nnodes, int)
                and isinstance(ep, str) and ep):
            declared = view.get("declared")
            self.membership = Membership(epoch=int(view.get("epoch") or 0), nnodes=nnodes,
                                         node_rank=rank, endpoint=ep,
                                         declared=declared if isinstance(declared, int)
                                         else None)
        else:
            self.membership = None
        self._save_state()

    def place(self, plan: protocol.ResumePlan | None) -> str | None:
        """Take the membership a restart command carries; returns why this node stands by
        (runs nothing: not a member, or a member missing), or None to launch."""
        m = plan.membership if plan is not None else None
        if not isinstance(m, dict):
            return None if self.role == NodeRole.MEMBER else "a spare runs nothing"
        raw = m.get("members")
        members: dict[str, Any] = raw if isinstance(raw, dict) else {}
        rank = members.get(self.cfg.node)
        epoch = int(m.get("epoch") or 0)
        if not isinstance(rank, int):
            self.role, self.membership = NodeRole.SPARE, None
            self._save_state()
            return f"not a member of membership epoch {epoch}: standing by as a spare"
        self.role = NodeRole.MEMBER
        declared = m.get("declared")
        self.membership = Membership(epoch=epoch, nnodes=int(m.get("nnodes") or len(members)),
                                     node_rank=rank, endpoint=str(m.get("endpoint") or ""),
                                     declared=declared if isinstance(declared, int) else None)
        self._save_state()
        waiting = m.get("waiting") or []
        if waiting or not self.membership.endpoint:
            return (f"node rank(s) {', '.join(map(str, waiting))} have no node yet: standing "
                    "by until a spare or the missing node joins")
        return None

    def stand_by(self, attempt: int, reason: str) -> None:
        """Run nothing for ``attempt`` (the executor's restart found this node not to run)."""
        self._attempt = attempt
        self._save_state()
        self.set_state(AgentState.SPARE)
        self._emit({"type": "event", "t": self.clock(), "attempt": attempt,
                    "name": protocol.AgentEventName.STANDING_BY, "message": reason,
                    "details": {"role": self.role}})

    def _check_role(self) -> None:
        """A reply said this node is not a member (it was replaced while it was silent): its
        workers are stopped at once, before they write anything more."""
        told = self.uplink.role
        if told != NodeRole.SPARE or self.role == NodeRole.SPARE or self.executor.busy:
            return
        self.role, self.membership = NodeRole.SPARE, None
        self._save_state()
        running = self.launcher.running or self.launcher.stopping
        log.warning("the supervisor says this node is no longer a member of run %s "
                    "(membership epoch %s): %s", self.cfg.run, self.uplink.epoch,
                    "killing its workers" if running else "standing by as a spare")
        if running:
            self.begin_stop(immediate=True)
        if not running:
            self.set_state(AgentState.SPARE)
        self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                    "name": protocol.AgentEventName.NOT_A_MEMBER,
                    "message": "no longer a member: workers stopped, standing by as a spare",
                    "details": {"epoch": self.uplink.epoch, "workers_killed": running}})

    def _check_wake(self) -> None:
        """This agent (and so its node) was stopped past the node-lost deadline (SIGSTOP, a
        frozen VM): the supervisor may have given its rank to a spare, so its workers are
        killed before they write anything, and the supervisor's next word decides."""
        now = self.clock()
        gap, self._last_tick = now - self._last_tick, now
        if (self.node_lost_s is None or gap <= self.node_lost_s
                or not (self.launcher.running or self.launcher.stopping)):
            return
        log.warning("this agent did not run for %.1f s (past the node-lost deadline of %.0f s):"
                    " killing the workers until the supervisor says what this node is", gap,
                    self.node_lost_s)
        self.begin_stop(immediate=True)
        self._emit({"type": "event", "t": now, "attempt": self._attempt,
                    "name": protocol.AgentEventName.WOKE_UP,
                    "message": f"the agent did not run for {gap:.1f} s: workers killed",
                    "details": {"gap_s": round(gap, 3), "node_lost_s": self.node_lost_s}})

    def _realign_membership(self) -> None:
        """A registration answered after torchrun was launched as written (the supervisor was
        away at the start): the other members run the static rendezvous of the membership
        the supervisor decided, and would wait on this node for ever.  Relaunch this node's
        workers as its node rank (the same attempt, from the newest checkpoint), or stop
        them when it is a spare."""
        if not (self.launcher.running or self.launcher.stopping) or self.executor.busy:
            return
        if self.role == NodeRole.MEMBER:
            if self.membership is None:
                return
            want = rewrite(self.cfg.command, self.membership,
                           rendezvous_timeout_s=self.cfg.rendezvous_timeout_s)
            if self.launcher.command == want:
                return
        log.warning("the supervisor answered after torchrun was launched as written: "
                    "relaunching attempt %d as %s", self._attempt,
                    f"node rank {self.membership.node_rank} of membership epoch "
                    f"{self.membership.epoch}" if self.membership is not None
                    and self.role == NodeRole.MEMBER else "a spare (nothing runs)")
        self.launcher.stop()
        self._emit({"type": "event", "t": self.clock(), "attempt": self._attempt,
                    "name": protocol.AgentEventName.MEMBERSHIP_REALIGNED,
                    "message": "relaunched for the membership the supervisor decided",
                    "details": {"role": self.role,
                                "node_rank": self.membership.node_rank
                                if self.membership is not None else None,
                                "epoch": self.membership.epoch
                                if self.membership is not None else None}})
        if self.role == NodeRole.MEMBER:
            self.launch(self._attempt, self.plan_path)
        else:
            self.exit_reported = True  # a spare's stop is no exit of the run's
            self.set_state(AgentState.SPARE)

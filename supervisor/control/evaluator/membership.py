"""A run's membership re-planned: a missing node's rank filled, a shrunk run grown back, a
cordoned member of a restart replaced, an agent on another attempt realigned."""

from __future__ import annotations

import logging

from trainwarden.agent import protocol
from trainwarden.supervisor.control import actions, membership, policy
from trainwarden.supervisor.control.evaluator.base import EvaluatorBase, TickReport
from trainwarden.supervisor.enums import (
    IN_PROGRESS,
    IncidentKind,
    IncidentStatus,
    RestartCause,
    RunStatus,
    SupervisorEvent,
)
from trainwarden.supervisor.store import membership as store_membership
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry, windows
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import RunRow

log = logging.getLogger("trainwarden.evaluator")


class MembershipJudge(EvaluatorBase):
    """Re-plans the members of each active run, and realigns agents on another attempt."""

    def _fill_missing(self, conn: Connection, run: RunRow, now: float,
                      rep: TickReport) -> None:
        """A run whose attempt stands by for a missing node restarts as soon as a node can
        take that rank (a spare registered, the lost node came back)."""
        ranks, waiting = actions.waiting_for(conn, run)
        if not ranks:
            return
        plan, _, _ = actions.plan_members(conn, run_id=int(run["id"]), now=now,
                                          live_s=self._live_s())
        if len(plan.waiting) >= len(ranks):
            return
        joined = [r.new for r in plan.replaced] or sorted(
            set(plan.members.values()) & waiting)
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
        decision = policy.on_node_joined(actions.facts(run), joined=joined,
                                         checkpoint=ckpt["path"] if ckpt else None, now=now)
        rep.decisions += 1
        log.info("run %s: %s", run["name"], decision)
        actions.apply(conn, run=run, decision=decision, now=now, live_s=self._live_s())

    def _grow_back(self, conn: Connection, run: RunRow, busy: bool, now: float,
                   rep: TickReport) -> None:
        """A shrunk run with a node free again (a spare registered, the lost node came back)
        grows back to its declared world at its next checkpoint: first the plan is recorded
        (``grow_planned``, with the highest step trained so far), then the first complete
        checkpoint of a later step restarts the gang from it on every node."""
        if run["status"] != RunStatus.RUNNING or busy:
            return
        m = store_membership.run_membership(conn, run_id=int(run["id"]))
        world, declared = m["world"], m["nnodes"]
        if world is None or declared is None or world >= declared:
            return
        plan, _, _ = actions.plan_members(conn, run_id=int(run["id"]), now=now,
                                          live_s=self._live_s(), grow=True)
        if plan.nnodes is None or plan.nnodes <= world:
            return
        joined = [r.new for r in plan.replaced]
        ev = windows.latest_event(conn, run_id=run["id"], attempt=run["attempt"],
                                  name=SupervisorEvent.GROW_PLANNED)
        details = ev["details"] if ev is not None and isinstance(ev["details"], dict) else {}
        if ev is None or details.get("epoch") != m["epoch"]:
            after = actions.high_step(conn, int(run["id"]))
            rec.insert_event(
                conn, run_id=run["id"], agent_id=None, attempt=int(run["attempt"]), rank=None,
                t=now, name=SupervisorEvent.GROW_PLANNED, step=after,
                message=f"{', '.join(joined)} free: the run grows back from {world} to "
                        f"{plan.nnodes} nodes at its next checkpoint",
                details={"epoch": m["epoch"], "after_step": after, "nodes": joined})
            return
        after = details.get("after_step")
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
        if ckpt is None or (isinstance(after, int) and int(ckpt["step"]) <= after):
            return
        decision = policy.on_grow(actions.facts(run), joined=joined, world=world,
                                  declared=plan.nnodes, checkpoint=ckpt["path"],
                                  step=int(ckpt["step"]), now=now)
        rep.decisions += 1
        log.info("run %s: %s", run["name"], decision)
        actions.apply(conn, run=run, decision=decision, now=now, live_s=self._live_s())

    def _replace_cordoned(self, conn: Connection, run: RunRow, now: float,
                          rep: TickReport) -> None:
        """A restart that has not resumed yet, one of whose members is cordoned now, is
        decided again with the same plan so a free spare takes that rank (no spare: it goes
        on; the next restart stands the rank by).  One cordoned for silent data corruption is
        never kept: the run shrinks without it if it may, else it is stopped."""
        action = rec.restart_action_for(conn, run_id=run["id"], attempt=run["attempt"])
        if action is None or action["status"] not in IN_PROGRESS:
            return
        m = (action["plan"] or {}).get("membership")
        if not isinstance(m, dict):
            return
        reasons = actions.cordon_reasons(conn, run_id=int(run["id"]))
        bad = sorted(set(m.get("members") or {}) & set(reasons))
        if not bad:
            return
        plan, _, _ = actions.plan_members(conn, run_id=int(run["id"]), now=now, live_s=None)
        # A member cordoned for silent data corruption never keeps its rank: with no spare to
        # take it (its rank waits), the run stops rather than rolls back onto it again.
        stuck = {node: reasons[node] for node in (plan.members.get(k) for k in plan.waiting)
                 if node is not None and node in bad and policy.corrupting(reasons[node])}
        # (a shrink that leaves it out is decided again too)
        shrunk = any(d.why == membership.CORRUPTING for d in plan.dropped)
        if not (stuck or plan.replaced or shrunk):
            return
        pending = protocol.ResumePlan.from_dict({k: v for k, v in (action["plan"] or {}).items()
                                        if k != "membership"})
        decision: policy.Restart | policy.Stop = (
            policy.on_corrupting_member(actions.facts(run), cordoned=stuck, pending=pending,
                                        sdc_rollback=action["cause"] == RestartCause.SDC)
            if stuck else policy.on_member_cordoned(actions.facts(run), cordoned=bad,
                                                    pending=pending, now=now))
        rep.decisions += 1
        log.info("run %s: %s", run["name"], decision)
        actions.apply(conn, run=run, decision=decision, now=now, live_s=None)

    def _attempt_mismatches(self, conn: Connection, run: RunRow, busy: bool, now: float,
                            rep: TickReport) -> None:
        """Agents whose reports carry another attempt than the run's: none of what they
        report counts for the run's attempt, so the policy realigns them within seconds, or
        opens an incident that says why (``policy.on_attempt_mismatch``).  A restart under
        way (an action in progress, a command in flight to the agent) is not a mismatch."""
        state = self._state(run)
        attempt = int(run["attempt"])
        open_incidents = {i["agent_id"]: i for i in rec.incidents_of(
            conn, run_id=run["id"], kinds=[IncidentKind.ATTEMPT_MISMATCH],
            status=IncidentStatus.OPEN)}
        tracked = set()
        off = registry.agents_off_attempt(conn, run_id=run["id"], attempt=attempt)
        off_ids = {ag["id"] for ag in off}
        for aid in [k for k in open_incidents if k is not None and k not in off_ids]:
            rec.resolve_incident(conn, incident_id=open_incidents[aid]["id"], now=now)
        for ag in off:
            aid = ag["id"]
            cmds = rec.agent_commands(conn, agent_id=aid)
            if busy or any(c["action_id"] is not None for c in cmds):
                continue
            reported = ag["attempt"]
            prev = state.mismatch.get(aid)
            if prev is None or prev[0] != reported:
                prev = state.mismatch[aid] = (reported, now)
            tracked.add(aid)
            sent = [c for c in cmds if c["action_id"] is None and c["attempt"] == attempt
                    and float(c["created_at"]) >= prev[1]]
            facts = policy.MismatchFacts(
                agent_id=aid, node=ag["node"], agent_attempt=reported, run_attempt=attempt,
                mismatch_s=now - prev[1], agent_state=ag["state"] or "",
                last_seen_s=now - float(ag["last_seen_at"] or now),
                realign=policy.RealignSent(status=sent[-1]["status"],
                                           age_s=now - float(sent[-1]["created_at"]),
                                           detail=sent[-1]["detail"] or "") if sent else None,
                incident_open=aid in open_incidents)
            decision = policy.on_attempt_mismatch(facts, self.cfg)
            if isinstance(decision, policy.Realign):
                rep.decisions += 1
                log.warning("run %s: %s", run["name"], decision.reason)
                actions.realign(conn, run=run, node=ag["node"], decision=decision, now=now)
            elif isinstance(decision, policy.OpenIncident):
                rep.decisions += 1
                log.error("run %s: %s", run["name"], decision.incident.cause)
                actions.apply(conn, run=run, decision=decision, now=now)
        for gone in state.mismatch.keys() - tracked:
            del state.mismatch[gone]


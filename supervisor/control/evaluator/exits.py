"""The agents' exit reports: each judged by the policy in the order they arrived, a late
one re-attributing the crash incident it explains."""

from __future__ import annotations

import logging

from trainwarden.agent import protocol
from trainwarden.agent.core.states import LIVE_AGENT_STATES, NodeRole
from trainwarden.supervisor.control import actions, policy
from trainwarden.supervisor.control.detection import lost_deadline
from trainwarden.supervisor.control.evaluator.base import EvaluatorBase, TickReport
from trainwarden.supervisor.detect.node_lost import silent_members
from trainwarden.supervisor.enums import ActionStatus, IncidentKind, JudgeStage, Verdict
from trainwarden.supervisor.store import membership as store_membership
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry, windows
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import ExitRow, RunRow

log = logging.getLogger("trainwarden.evaluator")


class ExitJudge(EvaluatorBase):
    """Judges the agents' exit reports (``policy.on_exit``)."""

    def _exits(self, conn: Connection, now: float, rep: TickReport) -> None:
        """Every agent exit report not handled yet, in the order they arrived."""
        for ex in rec.unhandled_exits(conn):
            run_id = int(ex["run_id"])
            if run_id in self._failed_this_tick:
                continue  # a run's exits are judged in order: its later ones wait
            rep.exits += 1
            with self._contained(conn, run_id, JudgeStage.EXITS, now):
                # Fresh run state each time: an earlier exit in this tick may have moved it.
                run = registry.get_run(conn, run_id=run_id)
                decision = self._on_exit(conn, run, ex, now)
                if not isinstance(decision, policy.Note):
                    rep.decisions += 1
                    log.info("run %s: %s", run["name"], decision)
                actions.apply(conn, run=run, decision=decision, now=now,
                              live_s=self._live_s())
                if isinstance(decision, policy.Note) and decision.verdict == Verdict.LATE:
                    self._reattribute(conn, run, ex, now)
                if isinstance(decision, policy.Note) and decision.verdict == Verdict.WAIT:
                    # Held (a survivor's lost connection): judged again on the next tick.  The
                    # run's later exits go on being judged: one of them may be the cause.
                    continue
                self._held_exits.pop(int(ex["id"]), None)
                verdict = decision.verdict if isinstance(decision, policy.Note) else (
                    Verdict.COMPLETED if isinstance(decision, policy.Complete) else Verdict.FAILURE
                )
                rec.mark_exit(conn, exit_id=ex["id"], verdict=verdict)

    @staticmethod
    def _exit_facts(conn: Connection, run: RunRow, ex: ExitRow) -> policy.ExitFacts:
        attempt = int(ex["attempt"])
        return policy.ExitFacts(
            id=ex["id"], agent_id=ex["agent_id"], node=ex["node"], attempt=attempt,
            outcome=ex["outcome"], exit_code=ex["exit_code"], signal=ex["signal"],
            failed_ranks=list(ex["failed_ranks"] or []),
            rank_steps={int(r["rank"]): int(r["step"]) for r in windows.rank_progress(
                conn, run_id=run["id"], attempt=attempt)},
            peer_error_ranks=windows.ranks_with_event(
                conn, run_id=run["id"], attempt=attempt,
                name=protocol.WorkerEventName.DISTRIBUTED_ERROR),
        )

    def _reattribute(self, conn: Connection, run: RunRow, ex: ExitRow, now: float) -> None:
        """A late exit of the attempt a crash incident ended may name the rank at fault
        where the incident named a survivor (``policy.reattribute``)."""
        (inc,) = rec.incidents_of(conn, run_id=run["id"], attempt=int(ex["attempt"]),
                                  kinds=[IncidentKind.CRASH])[:1] or (None,)
        if inc is None:
            return
        spec = policy.reattribute(inc, self._exit_facts(conn, run, ex))
        if spec is None:
            return
        rec.update_incident(conn, incident_id=inc["id"], cause=spec.cause, node=spec.node,
                            rank=spec.rank, agent_id=spec.agent_id, exit_code=spec.exit_code,
                            signal=spec.signal, details={**spec.details,
                                                         "survivor": inc["cause"]},
                            updated_at=now)
        log.info("run %s: incident %s names %s rank %s (it named a survivor)", run["name"],
                 inc["id"], spec.node, spec.rank)

    def _on_exit(self, conn: Connection, run: RunRow, ex: ExitRow, now: float
                 ) -> policy.Decision:
        """The policy's decision on one exit, given the run's state in the store."""
        members = [a for a in registry.run_agents(conn, run_id=run["id"])
                   if a["role"] == NodeRole.MEMBER]  # a spare runs nothing
        agent_ids = frozenset(a["id"] for a in members)
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
        pending = rec.restart_action_for(conn, run_id=run["id"], attempt=run["attempt"])
        restart_pending = pending is not None and pending["status"] in (
            ActionStatus.QUEUED, ActionStatus.DELIVERED) and ex["attempt"] == run["attempt"] - 1
        attempt = int(ex["attempt"])
        facts = self._exit_facts(conn, run, ex)
        completed = rec.completed_agents(
            conn, run_id=run["id"], attempt=attempt if restart_pending else run["attempt"])
        lost = lost_deadline(self.detection, self.advised_batch_interval())
        silent = silent_members(
            {a["node"]: float(a["last_seen_at"] or 0.0) for a in members
             if a["id"] != ex["agent_id"] and a["state"] in LIVE_AGENT_STATES},
            now, lost, observing_since=self.observing_since) if attempt == run["attempt"] else {}
        first = self._held_exits.setdefault(int(ex["id"]), now)
        host = store_membership.run_membership(conn, run_id=run["id"])["members"].get(0)
        return policy.on_exit(
            actions.facts(run), facts, agent_ids=agent_ids,
            completed_agent_ids=frozenset(completed), restart_pending=restart_pending,
            recovery=actions.recovery(conn, run), checkpoint=ckpt["path"] if ckpt else None,
            cfg=self.cfg, now=now, silent_peers=silent,
            may_wait=now - first < lost.confirm_wait_s,
            # a member heard within the node-lost deadline is alive: its own report is due
            may_wait_for_member=now - first < lost.deadline_s,
            rendezvous=policy.RendezvousFacts(host=host["node"] if host else None))

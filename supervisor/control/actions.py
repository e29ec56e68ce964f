"""Carry out policy decisions in the store: incident, audited action row, commands, run status.

Also advances an action's progress from what the agents report:
restart: queued -> delivered (every agent acknowledged) -> restarted (every agent reports
"done") -> resumed (first step report of the new attempt; the step is recorded);
stop: queued -> delivered -> done.  Any agent reporting "failed" marks the action failed.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from trainwarden.agent.core.states import CommandKind, CommandStatus, NodeRole, RunEnd
from trainwarden.agent.protocol import ResumePlan, StopPlan
from trainwarden.supervisor.control import membership, policy
from trainwarden.supervisor.control.policy import (
    Complete,
    Decision,
    FindingDecision,
    IncidentSpec,
    Note,
    OpenIncident,
    RecordEvent,
    Restart,
    Stop,
)
from trainwarden.supervisor.enums import (
    FINAL_STATUSES,
    INTERRUPTING,
    ActionKind,
    ActionStatus,
    Actor,
    IncidentKind,
    IncidentStatus,
    RunStatus,
    SupervisorEvent,
)
from trainwarden.supervisor.store import efficiency as eff
from trainwarden.supervisor.store import hosts, registry, windows
from trainwarden.supervisor.store import membership as store_membership
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.membership import RunMembership
from trainwarden.supervisor.store.rows import ActionRow, RunRow


def recovery(conn: Connection, run: RunRow, steps: list[int] | None = None
             ) -> policy.RecoveryFacts:
    """The run's history a restart or rollback decision needs (see ``policy.RecoveryFacts``);
    ``steps``: steps whose batch index the decision may name."""
    run_id = int(run["id"])
    ckpts = [(s, p) for s, _, p in rec.lineage_checkpoints(conn, run_id=run_id)]
    every = rec.restart_history(conn, run_id=run_id)
    history = [h for h in every if h["actor"] == Actor.POLICY]
    # A checkpoint's step: its batch in the newest attempt that trained it.  A step the
    # decision names (a spike's start, where it was detected): its batch in the run's
    # current attempt only.  An earlier attempt trained that step on another batch where a
    # rollback skipped some, and rank 0's row of the step may not be stored yet when another
    # rank's already showed the spike: then the policy counts on from the start's batch.
    named = sorted(set(steps or []))
    batch_index = rec.batch_indexes(conn, run_id=run_id,
                                    steps=sorted({s for s, _ in ckpts} - set(named)))
    batch_index.update(rec.batch_indexes(conn, run_id=run_id, steps=named,
                                         attempt=int(run["attempt"])))
    return policy.RecoveryFacts(
        checkpoints=tuple(ckpts),
        batch_index=batch_index,
        restarts_by_cause=policy.restart_counts(every).automatic,
        high_step=high_step(conn, run_id),
        high_at_restarts=tuple(h["high_step"] for h in history),
        previous_failure=previous_failure(conn, run),
        previous_signature=previous_failure(conn, run, key="signature"),
    )


def previous_failure(conn: Connection, run: RunRow, key: str = "fingerprint") -> str | None:
    """The fingerprint of the user-code failure that ended the run's previous attempt (the
    policy put it on that attempt's crash incident), or None; ``key="signature"``: that
    failure's signature, whatever its class."""
    attempt = int(run["attempt"]) - 1
    if attempt < 0:
        return None
    for inc in rec.incidents_of(conn, run_id=int(run["id"]), attempt=attempt,
                                kinds=[IncidentKind.CRASH]):
        fp = (inc.get("details") or {}).get(key)
        if isinstance(fp, str):
            return fp
    return None


def high_step(conn: Connection, run_id: int) -> int | None:
    """The highest step the run ever reported (any attempt)."""
    return max(rec.max_steps(conn, run_id=run_id).values(), default=None)


def facts(run: RunRow) -> policy.RunFacts:
    return policy.RunFacts(id=run["id"], name=run["name"], status=run["status"],
                           attempt=run["attempt"], restarts=run["restarts"])


def _incident(conn: Connection, run_id: int, spec: IncidentSpec | None, now: float) -> int | None:
    if spec is None:
        return None
    return rec.open_incident(
        conn, run_id=run_id, kind=spec.kind, cause=spec.cause, attempt=spec.attempt,
        agent_id=spec.agent_id, node=spec.node, rank=spec.rank, exit_code=spec.exit_code,
        signal=spec.signal, details=spec.details, opened_at=now, updated_at=now, step=spec.step,
    )


def _fold_into_partition(conn: Connection, run_id: int, incident_id: int | None,
                         spec: IncidentSpec, now: float) -> None:
    """A partition named by a failed rendezvous (attempt N) caused the failure that ended
    the attempt before it (its collective timeout, a crash on the broken connection): those
    open incidents are resolved as its consequences, linked to it both ways, so the run
    shows one cause."""
    if incident_id is None or spec.attempt < 1:
        return
    folded = []
    for inc in rec.incidents_of(conn, run_id=run_id, attempt=spec.attempt - 1,
                                kinds=sorted(INTERRUPTING), status=IncidentStatus.OPEN):
        rec.update_incident(conn, incident_id=inc["id"], status=IncidentStatus.RESOLVED,
                            resolved_at=now, updated_at=now,
                            details={**(inc.get("details") or {}),
                                     "consequence_of": incident_id})
        folded.append({"id": inc["id"], "kind": inc["kind"], "node": inc["node"]})
    if folded:
        rec.update_incident(conn, incident_id=incident_id, updated_at=now,
                            details={**spec.details, "consequences": folded})


def _supersede_in_progress(conn: Connection, run_id: int, now: float) -> None:
    """Before a new decision (or the run's end) replaces the run's actions in progress, each
    is first moved on by the facts already stored: a restart whose attempt has reported steps
    did resume (its steps and the exit that ends the run can reach the store between two
    ticks), and only what is still in progress then is superseded, with the commands the
    agents have not picked up."""
    for a in rec.actions_in_progress(conn):
        if a["run_id"] == run_id:
            advance(conn, action=a, now=now)
    rec.supersede_commands(conn, run_id=run_id, now=now)
    for a in rec.actions_in_progress(conn):
        if a["run_id"] == run_id:
            rec.update_action(conn, action_id=a["id"], status=ActionStatus.SUPERSEDED,
                              updated_at=now,
                              progress={**a["progress"], ActionStatus.SUPERSEDED: now})


def waiting_for(conn: Connection, run: RunRow) -> tuple[set[int], set[str]]:
    """The node ranks the run's current attempt stands by for (its restart's membership has
    ranks waiting: no node fit to run, no spare), and their missing nodes; empty when it
    runs."""
    action = rec.restart_action_for(conn, run_id=run["id"], attempt=run["attempt"])
    m = (action["plan"] or {}).get("membership") if action is not None else None
    if not isinstance(m, dict) or not m.get("waiting"):
        return set(), set()
    ranks = {int(k) for k in m["waiting"]}
    return ranks, {str(node) for node, rank in (m.get("members") or {}).items()
                   if rank in ranks}


def restart_members(conn: Connection, run: RunRow) -> set[str]:
    """The nodes the restart of the run's current attempt gave node ranks to (the ones it
    waits for among them); empty without one."""
    action = rec.restart_action_for(conn, run_id=run["id"], attempt=run["attempt"])
    m = (action["plan"] or {}).get("membership") if action is not None else None
    return {str(n) for n in (m.get("members") or {})} if isinstance(m, dict) else set()


def member_facts(conn: Connection, *, run_id: int, now: float, live_s: float | None,
                 lost: frozenset[str] = frozenset(), cut_off: frozenset[str] = frozenset()
                 ) -> tuple[membership.MembershipFacts, RunMembership]:
    """The store's facts about a run's nodes for ``control.membership``: a node is live when
    heard from within ``live_s`` (None: every node counts as live), unless its death was
    confirmed (``lost``); ``cut_off``: members a network partition cut off from the
    rendezvous host (live, not fit to hold their ranks for the next attempt)."""
    m = store_membership.run_membership(conn, run_id=run_id)
    live = frozenset(n["node"] for n in m["nodes"]
                     if (live_s is None or now - n["last_seen_at"] <= live_s)
                     and n["node"] not in lost and not store_membership.confirmed_lost(n))
    # A node on probation is taken after the healthy spares (it must pass a preflight).
    probation = hosts.probation_nodes(conn)
    reasons = cordon_reasons(conn, run_id=run_id)
    spares = sorted((n["node"] for n in m["spares"]), key=lambda node: node in probation)
    facts = membership.MembershipFacts(
        nnodes=m["nnodes"], epoch=m["epoch"],
        members={rank: n["node"] for rank, n in m["members"].items()}, live=live,
        spares=spares, cordoned=frozenset(reasons), world=m["world"],
        corrupting=frozenset(n for n, why in reasons.items() if policy.corrupting(why)),
        min_nodes=m["min_nodes"], cut_off=cut_off,
        spares_configured=any(n["joined_as"] == NodeRole.SPARE for n in m["nodes"]))
    return facts, m


def cordoned_for(conn: Connection, *, run_id: int) -> set[str]:
    """The nodes a run must not choose as members: those the shared ledger cordons, and
    those cordoned in this run only."""
    return hosts.cordoned_nodes(conn) | set(hosts.run_cordons(conn, run_id=run_id))


def cordon_reasons(conn: Connection, *, run_id: int) -> dict[str, str]:
    """``cordoned_for``'s nodes, each with why (the shared ledger's reason first)."""
    return {**hosts.run_cordons(conn, run_id=run_id), **hosts.cordon_reasons(conn)}


def capacity(conn: Connection, *, run_id: int, now: float, live_s: float | None
             ) -> membership.Capacity:
    """The run's nodes as shown and exported (``membership.capacity``)."""
    facts, m = member_facts(conn, run_id=run_id, now=now, live_s=live_s)
    run = registry.get_run(conn, run_id=run_id)
    return membership.capacity(
        facts, spares_configured=any(n["joined_as"] == NodeRole.SPARE for n in m["nodes"]),
        ended=run["status"] in FINAL_STATUSES)


def plan_members(conn: Connection, *, run_id: int, now: float, live_s: float | None,
                 grow: bool = False, move_endpoint: bool = False,
                 lost: frozenset[str] = frozenset(), cut_off: frozenset[str] = frozenset()
                 ) -> tuple[membership.MemberPlan, RunMembership, policy.ResizeChoice | None]:
    """The members the next attempt gets (``membership.plan_members`` on the store's
    facts), and, when a node rank has no node fit to run and the run accepts fewer nodes,
    the policy's choice between shrinking and waiting (None: there was none to make)."""
    facts, m = member_facts(conn, run_id=run_id, now=now, live_s=live_s, lost=lost,
                            cut_off=cut_off)
    plan = membership.plan_members(facts, grow=grow, move_endpoint=move_endpoint)
    if not (plan.waiting or plan.kept_cordoned) or not membership.can_shrink(facts):
        return plan, m, None
    world = facts.current or len(plan.members)
    fit = world - len(plan.waiting) - len(plan.kept_cordoned)
    choice = policy.choose_shrink(declared=plan.full or world, world=world, fit=fit,
                                  min_nodes=facts.min_nodes,
                                  figures=policy.ElasticFigures(
                                      **eff.elastic_figures(conn, run_id=run_id)))
    if choice.shrink:
        plan = membership.plan_members(facts, shrink=True)
    return plan, m, choice


def _apply_members(conn: Connection, *, run: RunRow, plan: membership.MemberPlan,
                   m: RunMembership, now: float, choice: policy.ResizeChoice | None = None
                   ) -> tuple[list[int], dict[str, Any] | None]:
    """Record the attempt's members; returns the agents its restart commands go to (the
    members fit to run: a waiting rank's missing node gets none) and the membership the
    commands carry (None: the command declares no world)."""
    by_node = {n["node"]: n["agent_id"] for n in m["nodes"]}
    if plan.nnodes is None:
        return [n["agent_id"] for n in m["nodes"]], None
    store_membership.assign(conn, run_id=int(run["id"]), epoch=plan.epoch,
                            members={rank: by_node[node] for rank, node in plan.members.items()},
                            world=plan.nnodes if plan.nnodes != plan.full else None)
    endpoint = store_membership.rendezvous(
        store_membership.run_membership(conn, run_id=int(run["id"])))
    attempt = int(run["attempt"])
    if plan.replaced or plan.moved:
        rec.insert_event(
            conn, run_id=run["id"], agent_id=None, attempt=attempt, rank=None, t=now,
            name=SupervisorEvent.MEMBERSHIP_CHANGED, step=None, message=plan.summary(),
            details={"epoch": plan.epoch, "members": {str(k): v for k, v in plan.members.items()},
                     "replaced": [dataclasses.asdict(r) for r in plan.replaced],
                     "endpoint": endpoint, "moved": plan.moved})
    if plan.resized:
        rec.insert_event(
            conn, run_id=run["id"], agent_id=None, attempt=attempt, rank=None, t=now,
            name=SupervisorEvent.WORLD_RESIZED, step=None, message=plan.summary(),
            details={"from": plan.world_before, "to": plan.nnodes, "declared": plan.full,
                     "dropped": [dataclasses.asdict(d) for d in plan.dropped],
                     "members": {str(k): v for k, v in plan.members.items()},
                     "choice": choice.reason if choice is not None else None})
    if plan.waiting:
        rec.insert_event(
            conn, run_id=run["id"], agent_id=None, attempt=attempt, rank=None, t=now,
            name=SupervisorEvent.WAITING_FOR_NODE, step=None, message=plan.summary(),
            details={"waiting": {str(k): v for k, v in plan.missing.items()}})
    waiting = {plan.members.get(k) for k in plan.waiting}
    targets = [by_node[node] for _, node in sorted(plan.members.items()) if node not in waiting]
    return targets, plan.wire(endpoint)


def apply(conn: Connection, *, run: RunRow, decision: Decision | FindingDecision,
          now: float, live_s: float | None = None) -> int | None:
    """Write what ``decision`` means; returns the action id when one was created.  A restart
    decides its attempt's members too (``plan_members``; ``live_s``: the node-lost deadline,
    for a restart that replaces lost members)."""
    run_id = int(run["id"])
    if isinstance(decision, Note):
        return None
    if isinstance(decision, OpenIncident):
        _incident(conn, run_id, decision.incident, now)
        return None
    if isinstance(decision, RecordEvent):
        rec.insert_event(conn, run_id=run_id, agent_id=None, attempt=int(run["attempt"]),
                          rank=decision.rank, t=now, name=decision.name, step=decision.step,
                          message=decision.message, details=decision.details)
        return None
    if isinstance(decision, Complete):
        _supersede_in_progress(conn, run_id, now)
        registry.set_run_status(conn, run_id=run_id, status=RunStatus.COMPLETED, now=now,
                                reason=decision.reason)
        _release_others(conn, run_id=run_id, attempt=int(run["attempt"]), now=now)
        return None
    agent_ids = [a["id"] for a in registry.run_agents(conn, run_id=run_id)]
    # A new decision replaces whatever the agents have not picked up yet.
    _supersede_in_progress(conn, run_id, now)
    incident_id = _incident(conn, run_id, decision.incident, now)
    if decision.incident is not None and decision.incident.kind == IncidentKind.PARTITION:
        _fold_into_partition(conn, run_id, incident_id, decision.incident, now)
    if isinstance(decision, Restart):
        store_membership.confirm_lost(conn, run_id=run_id, nodes=sorted(decision.lost), now=now)
        members, m, choice = plan_members(conn, run_id=run_id, now=now,
                                          live_s=live_s if decision.replace_lost else None,
                                          grow=decision.grow,
                                          move_endpoint=decision.move_endpoint,
                                          lost=decision.lost, cut_off=decision.cut_off)
        agent_ids, wire_members = _apply_members(conn, run=run, plan=members, m=m, now=now,
                                                 choice=choice)
        said = "; ".join(x for x in (members.summary(), choice.reason if choice else "") if x)
        if said:
            decision = dataclasses.replace(decision, reason=f"{decision.reason}; {said}")
        action_id = rec.create_action(
            conn, run_id=run_id, incident_id=incident_id, kind=ActionKind.RESTART,
            reason=decision.reason, actor=decision.actor, status=ActionStatus.QUEUED,
            attempt=decision.attempt, not_before=decision.not_before, created_at=now,
            cause=decision.cause, high_step=high_step(conn, run_id),
            rollback_to_step=decision.rollback_to_step,
        )
        if decision.rollback_to_step is not None:
            # The branch beyond the rollback point is abandoned: its checkpoints are never
            # offered as the newest again (the new attempt writes its own).
            rec.abandon_branches(conn, run_id=run_id)
        plan = decision.plan(action_id=action_id)
        if wire_members is not None:
            plan["membership"] = wire_members
        rec.update_action(conn, action_id=action_id, plan=plan)
        rec.create_commands(conn, rows=[
            {"run_id": run_id, "agent_id": aid, "action_id": action_id,
             "kind": CommandKind.RESTART,
             "attempt": decision.attempt, "plan": plan, "not_before": decision.not_before,
             "reason": decision.reason, "status": CommandStatus.PENDING, "sent_count": 0,
             "detail": "", "collect_stacks": decision.collect_stacks, "created_at": now,
             "updated_at": now}
            for aid in agent_ids
        ])
        restarts = int(run["restarts"]) + (1 if decision.counts_against_budget else 0)
        registry.set_run_status(conn, run_id=run_id, status=RunStatus.RESTARTING, now=now,
                                reason=decision.reason, attempt=decision.attempt,
                                restarts=restarts)
        return action_id
    assert isinstance(decision, Stop)
    action_id = rec.create_action(
        conn, run_id=run_id, incident_id=incident_id, kind=ActionKind.STOP,
        reason=decision.reason, actor=decision.actor, status=ActionStatus.QUEUED,
        attempt=int(run["attempt"]), created_at=now,
    )
    # Every stop ends the run: it says how, and the agents exit with that end's code.
    ends: StopPlan = {"run_status": RunEnd(decision.status)}
    rec.create_commands(conn, rows=[
        {"run_id": run_id, "agent_id": aid, "action_id": action_id, "kind": CommandKind.STOP,
         "attempt": int(run["attempt"]), "plan": dict(ends), "not_before": None,
         "reason": decision.reason, "status": CommandStatus.PENDING, "sent_count": 0,
         "detail": "", "created_at": now, "updated_at": now}
        for aid in agent_ids
    ])
    registry.set_run_status(conn, run_id=run_id, status=decision.status, now=now,
                            reason=decision.reason)
    return action_id


def _release_others(conn: Connection, *, run_id: int, attempt: int, now: float) -> None:
    """The run completed: its members' workers did, and their agents leave on their own;
    every other node (a spare, a replaced node) has nothing left to stand by for and is told
    to stop (a command outside any action), before its credential is revoked
    (``credentials.ended_runs_holding_credentials``)."""
    ends: StopPlan = {"run_status": RunEnd.COMPLETED}
    for n in store_membership.run_membership(conn, run_id=run_id)["spares"]:
        rec.create_commands(conn, rows=[{
            "run_id": run_id, "agent_id": n["agent_id"], "action_id": None,
            "kind": CommandKind.STOP, "attempt": attempt, "plan": dict(ends),
            "not_before": None,
            "reason": "the run completed: a spare has nothing left to stand by for",
            "status": CommandStatus.PENDING, "sent_count": 0, "detail": "",
            "collect_stacks": False, "created_at": now, "updated_at": now}])


def realign(conn: Connection, *, run: RunRow, node: str, decision: policy.Realign,
            now: float) -> None:
    """One command for one agent, outside any action: relaunch as the run's attempt.  No
    checkpoint is named (each worker resumes from the newest complete one of its own
    directory); an event on the run says why."""
    plan = json.loads(ResumePlan(attempt=decision.attempt, reason=decision.reason).to_json())
    rec.create_commands(conn, rows=[{
        "run_id": run["id"], "agent_id": decision.agent_id, "action_id": None,
        "kind": CommandKind.RESTART, "attempt": decision.attempt, "plan": plan,
        "not_before": None, "reason": decision.reason, "status": CommandStatus.PENDING,
        "sent_count": 0, "detail": "", "collect_stacks": False, "created_at": now,
        "updated_at": now}])
    rec.insert_event(conn, run_id=run["id"], agent_id=decision.agent_id,
                     attempt=int(run["attempt"]), rank=None, t=now,
                     name=SupervisorEvent.ATTEMPT_REALIGN, step=None, message=decision.reason,
                     details={"node": node, "attempt": decision.attempt})


def advance(conn: Connection, *, action: ActionRow, now: float) -> str:
    """Move one in-progress action forward from the store's facts; returns its status."""
    status = action["status"]
    progress = dict(action["progress"] or {})
    statuses = rec.action_command_statuses(conn, action_id=action["id"])
    new = status
    values: dict[str, Any] = {}
    if CommandStatus.FAILED in statuses:
        new = ActionStatus.FAILED
    else:
        acked = all(s in (CommandStatus.DELIVERED, CommandStatus.DONE) for s in statuses)
        done = all(s == CommandStatus.DONE for s in statuses)
        if new == ActionStatus.QUEUED and acked:
            new = ActionStatus.DELIVERED
            progress[ActionStatus.DELIVERED] = now
        if new == ActionStatus.DELIVERED and done:
            new = (ActionStatus.RESTARTED if action["kind"] == ActionKind.RESTART
                   else ActionStatus.DONE)
            progress[new] = now
        if action["kind"] == ActionKind.RESTART:
            span = windows.step_range(conn, run_id=action["run_id"], attempt=action["attempt"])
            if span is not None:
                first = span[0]
                new = ActionStatus.RESUMED
                values["resumed_step"] = first
                run = registry.get_run(conn, run_id=action["run_id"])
                if (run["status"] == RunStatus.RESTARTING
                        and run["attempt"] == action["attempt"]):
                    registry.set_run_status(conn, run_id=run["id"], status=RunStatus.RUNNING,
                                            now=now, reason=f"resumed at step {first}")
                rec.resolve_incidents(conn, run_id=action["run_id"], now=now)
    if new != status:
        progress[new] = now
        rec.update_action(conn, action_id=action["id"], status=new, progress=progress,
                           updated_at=now, **values)
    return new


def apply_host(conn: Connection, *, decision: policy.HostDecision, now: float) -> int | None:
    """Write a decision about a node's state (``store.hosts``), audited as a host action
    naming who and why; returns the host action's id (None: nothing changed)."""
    if isinstance(decision, policy.Cordon) and decision.in_run_only:
        assert decision.run_id is not None
        return hosts.cordon_in_run(conn, run_id=decision.run_id, node=decision.node,
                                   reason=decision.reason, actor=decision.actor, now=now,
                                   evidence_ids=decision.evidence_ids)
    if isinstance(decision, policy.Cordon):
        return hosts.cordon(conn, node=decision.node, reason=decision.reason,
                            actor=decision.actor, now=now, run_id=decision.run_id,
                            evidence_ids=decision.evidence_ids)
    if isinstance(decision, policy.Uncordon):
        return hosts.uncordon(conn, node=decision.node, reason=decision.reason,
                              actor=decision.actor, now=now)
    if isinstance(decision, policy.PassProbation):
        hosts.preflight_passed(conn, node=decision.node, now=now, run_id=decision.run_id,
                               reason=decision.reason, evidence_ids=decision.evidence_ids)
    return None

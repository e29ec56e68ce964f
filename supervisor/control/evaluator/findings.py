"""The detectors' findings and the workers' failure events handed to the policy; stack dumps
attached to the incident they were taken for, stragglers' incidents resolved."""

from __future__ import annotations

import logging
from typing import Any

from trainwarden.agent import protocol
from trainwarden.agent.core.findings import FindingKind, Severity
from trainwarden.supervisor.control import actions, policy
from trainwarden.supervisor.control.evaluator.base import EvaluatorBase, TickReport
from trainwarden.supervisor.control.observer import Observation
from trainwarden.supervisor.detect import Finding
from trainwarden.supervisor.detect.stacks import hang_culprit
from trainwarden.supervisor.enums import IncidentKind, IncidentStatus, JudgeStage
from trainwarden.supervisor.store import recovery as rec
from trainwarden.supervisor.store import registry, windows
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import IncidentRow, NodeEventRow, RunRow

log = logging.getLogger("trainwarden.evaluator")


# Worker events that end an attempt, with the incident kind they open.  A "distributed_error"
# (connection reset by a peer, ...) is left out on purpose: it is what the survivors see when
# a peer dies, and the agent's exit report that follows names the rank that really failed.
_FAILURE_EVENTS: dict[str, IncidentKind] = {
    protocol.WorkerEventName.COLLECTIVE_TIMEOUT: IncidentKind.COLLECTIVE_TIMEOUT,
    protocol.WorkerEventName.REPLICA_MISMATCH: IncidentKind.SDC}
_STACKS_EVENT = protocol.AgentEventName.STACKS
# Event findings whose detector already reports each episode once (from the store's events).
_EPISODE_EVENTS = frozenset({FindingKind.DISK_LOW, FindingKind.DISK_RECOVERED})


class FindingJudge(EvaluatorBase):
    """Hands findings and failure events to the policy (``policy.on_finding``)."""

    def _worker_events(self, conn: Connection, now: float, rep: TickReport) -> None:
        """Distributed failures reported by workers end their attempt; stack dumps are
        attached to the incident they were taken for."""
        names = [*_FAILURE_EVENTS, _STACKS_EVENT]
        retry, self._unattached = self._unattached, []
        for ev in retry:
            if now - float(ev["t"]) < 300:  # an incident that never comes: give up in time
                self._attach_stacks(conn, registry.get_run(conn, run_id=ev["run_id"]), ev, now)
        failed, self._retry_events = self._retry_events, []
        fresh = windows.events_after(conn, after_id=self._event_cursor, names=names)
        for ev in [*(e for e in failed if now - float(e["t"]) < 300), *fresh]:
            self._event_cursor = max(self._event_cursor, int(ev["id"]))
            run_id = int(ev["run_id"])
            if run_id in self._failed_this_tick:
                self._retry_events.append(ev)  # in order, after the one that failed
                continue
            with self._contained(conn, run_id, JudgeStage.EVENTS, now):
                self._worker_event(conn, ev, now, rep)
            if run_id in self._failed_this_tick:
                self._retry_events.append(ev)

    def _worker_event(self, conn: Connection, ev: NodeEventRow, now: float,
                      rep: TickReport) -> None:
        run = registry.get_run(conn, run_id=ev["run_id"])
        if ev["name"] == _STACKS_EVENT:
            if ev.get("member", True):  # (a non-member's stacks name no culprit)
                self._attach_stacks(conn, run, ev, now)
            return
        details = dict(ev.get("details") or {})
        if ev["name"] == protocol.WorkerEventName.REPLICA_MISMATCH:
            self._replica_mismatch(conn, run, ev, details, now, rep)
            return
        collective = details.get("collective", "unknown")
        rank = ev["rank"]
        if ev["step"] is None and rank is not None:
            # The step it was stuck in: the one after the last its rank reported.
            last = {int(r["rank"]): int(r["step"]) for r in windows.rank_progress(
                conn, run_id=run["id"], attempt=int(ev["attempt"]))}.get(rank)
            ev = {**ev, "step": None if last is None else last + 1}
        where = f"rank {ev['rank']}" + (f" on node {ev['node']}" if ev.get("node") else "")
        finding = policy.FindingFacts(
            kind=_FAILURE_EVENTS[ev["name"]], severity=Severity.INCIDENT,
            message=f"{ev['name'].replace('_', ' ')} in {collective} on {where}: "
                    f"{ev['message']}",
            attempt=int(ev["attempt"]), step=ev.get("step"), rank=ev.get("rank"),
            node=ev.get("node"), details={"collective": collective, "event_id": ev["id"],
                                          **details},
            member=bool(ev.get("member", True)))
        rep.findings += 1
        self._decide(conn, run, finding, now, rep)

    def _replica_mismatch(self, conn: Connection, run: RunRow, ev: NodeEventRow,
                          details: dict[str, Any], now: float, rep: TickReport) -> None:
        """Silent data corruption: the incident names the minority's rank and the node it
        ran on (the event comes from a rank of the majority, on whatever node)."""
        corrupt = [r for r in details.get("corrupt") or [] if isinstance(r, int)]
        rank = corrupt[0] if len(corrupt) == 1 else None
        nodes = windows.rank_nodes(conn, run_id=run["id"])
        node = nodes.get(rank) if rank is not None else None
        details["nodes"] = {str(r): nodes.get(r) for r in corrupt or details.get("suspects") or []
                            if isinstance(r, int)}
        step = details.get("first_disagreement", ev.get("step"))
        finding = policy.FindingFacts(
            kind=IncidentKind.SDC, severity=Severity.INCIDENT,
            message=policy.sdc_message(details, node), attempt=int(ev["attempt"]),
            step=step if isinstance(step, int) else None, rank=rank, node=node,
            # (who made the claim: the evidence it holds against another node counts for the
            # host only when that agent is trusted for its own: control.ledger)
            details={"event_id": ev["id"], **details, "reported_by": ev.get("node")},
            member=bool(ev.get("member", True)))
        rep.findings += 1
        self._decide(conn, run, finding, now, rep)

    def _attach_stacks(self, conn: Connection, run: RunRow, ev: NodeEventRow, now: float) -> None:
        details = ev.get("details") or {}
        incident_id = None
        if isinstance(details.get("command_id"), int):
            incident_id = rec.incident_for_command(conn, command_id=details["command_id"])
        if incident_id is None:  # the agent's own watchdog: the hang of that attempt
            hangs = rec.incidents_of(conn, run_id=run["id"], attempt=ev["attempt"],
                                      kinds=[IncidentKind.HANG])
            incident_id = hangs[-1]["id"] if hangs else None
        if incident_id is None:
            self._unattached.append(ev)  # the exit that opens the hang incident may follow
            return
        inc = rec.get_incident(conn, incident_id=incident_id)
        assert inc is not None
        before = inc["details"] or {}
        merged = {**before,
                  "stacks": {**(before.get("stacks") or {}), **(details.get("stacks") or {})},
                  "stacks_node": ev.get("node"),
                  "stacks_nodes": sorted({*(before.get("stacks_nodes") or []),
                                          *([ev["node"]] if ev.get("node") else [])})}
        values = _name_culprit(inc, merged, windows.rank_nodes(conn, run_id=run["id"]))
        rec.update_incident(conn, incident_id=incident_id, updated_at=now, **values)

    def _act_on(self, conn: Connection, run: RunRow, obs: Observation, now: float,
                rep: TickReport) -> None:
        """Hand one run's findings to the policy and apply its decisions."""
        if obs.stragglers is not None:
            self._resolve_ended_stragglers(conn, run, obs.stragglers, now)
        for f in obs.findings:
            if f.kind == FindingKind.RANK_STALLED:
                continue  # its hang (if it is one) is judged by the hang finding
            rep.findings += 1
            facts = policy.FindingFacts(
                kind=f.kind, severity=f.severity, message=f.message,
                attempt=obs.attempt, step=f.step, rank=f.rank, node=f.node,
                details=_jsonable(f.details), started_at=f.started_at)
            self._decide(conn, run, facts, now, rep)
            run = registry.get_run(conn, run_id=run["id"])  # a decision may have moved it

    def _resolve_ended_stragglers(self, conn: Connection, run: RunRow,
                                  slow: dict[int | None, Finding], now: float) -> None:
        """One episode, one incident: while its rank is flagged the incident is updated;
        it is resolved once the rank has not been flagged for a whole hold window (a score
        near the threshold flickers, and that must not open and close incidents)."""
        span = windows.step_range(conn, run_id=run["id"], attempt=run["attempt"])
        newest = span[1] if span else None
        hold = max(self.detection.straggler.hold_steps, self.detection.straggler.window_steps)
        for inc in rec.incidents_of(conn, run_id=run["id"], kinds=[IncidentKind.STRAGGLER],
                                     status=IncidentStatus.OPEN):
            details = dict(inc["details"] or {})
            f = slow.get(inc["rank"])
            if f is not None:
                fresh = {**details, "last_flagged_step": newest,
                         "score": f.details.get("score")}
                if fresh != details:  # touch the row only when the episode moved on
                    rec.update_incident(conn, incident_id=inc["id"], details=fresh,
                                         updated_at=now)
                continue
            last = details.get("last_flagged_step", details.get("flagged_at_step"))
            if inc["attempt"] != run["attempt"] or newest is None or last is None \
                    or newest - int(last) >= hold:
                rec.resolve_incident(conn, incident_id=inc["id"], now=now)

    def _decide(self, conn: Connection, run: RunRow, finding: policy.FindingFacts, now: float,
                rep: TickReport) -> None:
        this_attempt = rec.incidents_of(conn, run_id=run["id"], attempt=run["attempt"])
        open_watch = frozenset(
            (i["kind"], i["rank"] if i["kind"] == IncidentKind.STRAGGLER else None)
            for i in rec.incidents_of(conn, run_id=run["id"], status=IncidentStatus.OPEN)
            if i["kind"] in policy.WATCH_KINDS)
        ckpt = rec.newest_complete_checkpoint(conn, run_id=run["id"])
        decision = policy.on_finding(
            actions.facts(run), finding,
            incident_kinds_this_attempt=frozenset(i["kind"] for i in this_attempt),
            open_watch=open_watch, checkpoint=ckpt["path"] if ckpt else None,
            cfg=self.cfg, now=now,
            recovery=actions.recovery(conn, run, _named_steps(finding)),
            waiting_for=frozenset(actions.waiting_for(conn, run)[1]))
        if isinstance(decision, policy.Note):
            return
        if not isinstance(decision, policy.RecordEvent):
            rep.decisions += 1
            log.info("run %s: %s", run["name"], decision)
        elif decision.name not in _EPISODE_EVENTS and _seen_event(conn, run, decision):
            return
        actions.apply(conn, run=run, decision=decision, now=now, live_s=self._live_s())


def _name_culprit(inc: IncidentRow, details: dict[str, Any], rank_nodes: dict[int, str]
                  ) -> dict[str, Any]:
    """The incident's new values once (more) stacks are in: the culprit analysis in its
    details, the culprit's rank and node where the hang detector named none (no rank was
    behind), and its cause followed by the verdict, which says why when nobody is named."""
    stacks = {int(k): str(v) for k, v in (details.get("stacks") or {}).items()
              if str(k).isdigit()}
    culprit = hang_culprit(stacks, rank_nodes, details.get("stacks_nodes") or [])
    base = details.setdefault("cause_before_stacks", inc["cause"])
    details["culprit"] = culprit.as_details()
    values: dict[str, Any] = {"details": details, "cause": f"{base}; {culprit.reason}"}
    if culprit.ranks and (inc["rank"] is None or details.get("rank_from") == "stacks"):
        details["rank_from"] = "stacks"
        values["rank"] = culprit.ranks[0]
        values["node"] = rank_nodes.get(culprit.ranks[0])
    return values


def _named_steps(f: policy.FindingFacts) -> list[int]:
    """The steps whose batch index a decision on ``f`` may name: its step, the start of a
    spike before it (a loss that climbed to NaN) and where it was detected (a rollback skips
    from the start through the detection)."""
    steps = [f.step, f.details.get("start_step"), f.details.get("detected_at_step")]
    return sorted({s for s in steps if isinstance(s, int) and not isinstance(s, bool)})


def _seen_event(conn: Connection, run: RunRow, d: policy.RecordEvent) -> bool:
    """An event finding is recorded once per episode (same name and start step)."""
    prev = windows.latest_event(conn, run_id=run["id"], attempt=run["attempt"], name=d.name)
    return prev is not None and prev.get("step") == d.step


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    """Finding details as JSON the store accepts (no NaN/Inf, no tuples)."""
    import json
    import math

    def clean(x: object) -> object:
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [clean(v) for v in x]
        return x

    out = clean(d)
    json.dumps(out)
    assert isinstance(out, dict)
    return out

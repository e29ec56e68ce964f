"""The health ledger's share of an evaluator tick: evidence in, cordons out.

Each tick, inside the evaluator's write transaction and after the exits, events and
findings were judged (so this tick's incidents are there):

* the incidents opened or updated since the last tick (a crash, a collective timeout, a hang
  once its culprit is named, a straggler episode) become evidence against the node they
  blame (``detect.node_health.incident_evidence``: a user-code bug never does);
* the ``preflight`` events and the failed checkpoint saves stored since (in id order);
* every few seconds, the GPU readings of the active runs' agents (NVML's ECC and XID counts:
  evidence when they grew since last seen).

Each piece of evidence is recorded once (its source, ``incident:12`` or ``event:40``, is
unique per node; the GPU counters last seen are kept with the node), so reading a source
again (the next tick, the next leader, a restart) records nothing.  The nodes that got new
evidence are judged by the rule and the policy cordons (``policy.on_host_evidence``,
audited with the policy as the actor); a passed preflight ends a probation.  Cordoning
restarts nothing: the membership replaces a cordoned member at the next restart.

Evidence is bounded by its source.  Evidence about a node counts in the shared ledger (it
cordons the host for every run) only when the run's agent on that node is trusted for its host:
registered with a token scoped to no run (the cluster's own agents).  Evidence from an agent
registered with a run-scoped token is recorded as that run's only (``trusted`` false): the same
rule, judged over that run's evidence, cordons the node in that run only (the run replaces it
at its next restart), and a passed preflight from it ends no probation.  Only members' evidence
counts: a spare's or a replaced node's events and readings are never evidence.

What the ledger keeps between ticks is where it read up to; it moves on only once the
tick's transaction committed (``advance``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from trainwarden.agent import protocol
from trainwarden.supervisor.control import actions, policy
from trainwarden.supervisor.detect import node_health
from trainwarden.supervisor.detect.node_health import CordonConfig, Found
from trainwarden.supervisor.enums import EvidenceKind, HostState, IncidentKind
from trainwarden.supervisor.store import hosts, registry, windows
from trainwarden.supervisor.store.db import Connection
from trainwarden.supervisor.store.rows import IncidentRow, NodeEventRow

log = logging.getLogger("trainwarden.ledger")

# The event a node's preflight reports (details: passed, failed, checks).
PREFLIGHT_EVENT = "preflight"
_EVENTS = (PREFLIGHT_EVENT, protocol.WorkerEventName.CHECKPOINT_FAILED)
_INCIDENT_KINDS = (IncidentKind.CRASH, IncidentKind.COLLECTIVE_TIMEOUT, IncidentKind.HANG,
                   IncidentKind.STRAGGLER, IncidentKind.SDC)
GPU_EVERY_S = 5.0  # how often the GPU readings are compared with the counters last seen
SEEN_MAX = 100_000  # (node, source) pairs remembered as recorded (then forgotten, read again)
EVENT_PAGES = 5  # pages of 1,000 events read a tick at most (a backlog is read over ticks)


@dataclass
class LedgerTick:
    """What one tick read up to (``HealthLedger.advance`` keeps it once committed), and
    what it did."""

    incidents_since: float
    event_cursor: int
    gpu_next: float
    evidence: int = 0  # pieces recorded
    decisions: list[policy.HostDecision] = field(default_factory=list)
    recorded: list[tuple[str, str]] = field(default_factory=list)  # (node, source) in the store


class HealthLedger:
    def __init__(self, cfg: CordonConfig | None = None) -> None:
        self.cfg = cfg or CordonConfig()
        self._incidents_since: float | None = None  # None: the window before the first tick
        self._event_cursor = 0
        self._gpu_next = float("-inf")
        # Sources known to be recorded: an open straggler incident is touched on every tick
        # while it lasts, and need not be written again each time.
        self._seen: set[tuple[str, str]] = set()

    def tick(self, conn: Connection, now: float) -> LedgerTick:
        """Record the new evidence and apply the decisions it calls for (in ``conn``'s
        transaction); call ``advance`` with the result once that committed."""
        since = self._incidents_since
        t = LedgerTick(incidents_since=now, event_cursor=self._event_cursor,
                       gpu_next=self._gpu_next)
        run_names: dict[int, str] = {}
        # (node, run of its newest evidence or None, in that run only)
        touched: dict[tuple[str, int | None], bool] = {}
        start = now - self.cfg.window_s if since is None else since
        for inc in hosts.incidents_touched(conn, since=start, kinds=_INCIDENT_KINDS):
            self._incident(conn, inc, run_names, touched, t)
        self._events(conn, now, run_names, touched, t)
        if now >= self._gpu_next:
            self._gpus(conn, now, run_names, touched, t)
            t.gpu_next = now + GPU_EVERY_S
        shared: dict[str, int | None] = {}
        for (node, run_id), local in sorted(touched.items(), key=lambda kv: (kv[0][0],
                                                                              kv[0][1] or 0)):
            if local and run_id is not None:
                self._judge_in_run(conn, node, run_id, now, t)
            else:
                shared[node] = run_id
        for node, run_id in sorted(shared.items()):
            self._judge(conn, node, run_id, now, t)
        return t

    def advance(self, t: LedgerTick) -> None:
        self._incidents_since = t.incidents_since
        self._event_cursor = t.event_cursor
        self._gpu_next = t.gpu_next
        if len(self._seen) + len(t.recorded) > SEEN_MAX:
            self._seen.clear()
        self._seen.update(t.recorded)

    # -- evidence ------------------------------------------------------------------------------

    def _record(self, conn: Connection, found: Found, *, run_id: int | None,
                attempt: int | None, t: float, source: str | None,
                run_names: dict[int, str], touched: dict[tuple[str, int | None], bool],
                tick: LedgerTick, trusted: bool = True) -> int | None:
        if source is not None and (found.node, source) in self._seen:
            return None
        if run_id is None:
            trusted = True  # (the supervisor's own evidence)
        detail = dict(found.detail)
        if run_id is not None:
            if run_id not in run_names:
                run_names[run_id] = str(registry.get_run(conn, run_id=run_id)["name"])
            detail["run"] = run_names[run_id]
        new = hosts.record_evidence_once(conn, node=found.node, kind=found.kind, run_id=run_id,
                                         attempt=attempt, t=t, detail=detail, source=source,
                                         trusted=trusted)
        if source is not None:
            tick.recorded.append((found.node, source))
        if new is not None:
            tick.evidence += 1
            if found.kind != EvidenceKind.PREFLIGHT_PASSED:
                if trusted:  # the newest run per node: drop an older entry of the node
                    for key in [k for k in touched if k[0] == found.node and not touched[k]]:
                        del touched[key]
                touched[(found.node, run_id)] = not trusted
        return new

    def _incident(self, conn: Connection, inc: IncidentRow, run_names: dict[int, str],
                  touched: dict[tuple[str, int | None], bool], tick: LedgerTick) -> None:
        rank_nodes = (windows.rank_nodes(conn, run_id=inc["run_id"])
                      if inc["kind"] == IncidentKind.HANG else {})
        trust = hosts.node_trust(conn, run_id=inc["run_id"])
        # An incident one node reported about another (silent data corruption: the majority's
        # rank names the minority's) is that reporter's claim: trusted for the accused host
        # only when both agents are.
        reporter = (inc["details"] or {}).get("reported_by")
        for found in node_health.incident_evidence(
                inc["kind"], node=inc["node"], rank=inc["rank"], cause=inc["cause"],
                details=inc["details"] or {}, rank_nodes=rank_nodes, signal=inc["signal"],
                exit_code=inc["exit_code"]):
            found.detail["incident_id"] = inc["id"]
            self._record(conn, found, run_id=inc["run_id"], attempt=inc["attempt"],
                         t=float(inc["opened_at"]), source=f"incident:{inc['id']}",
                         run_names=run_names, touched=touched, tick=tick,
                         trusted=trust.get(found.node, False)
                         and (reporter is None or trust.get(reporter, False)))

    def _events(self, conn: Connection, now: float, run_names: dict[int, str],
                touched: dict[tuple[str, int | None], bool], tick: LedgerTick) -> None:
        for _ in range(EVENT_PAGES):
            page = windows.events_after(conn, after_id=tick.event_cursor, names=_EVENTS)
            for ev in page:
                tick.event_cursor = max(tick.event_cursor, int(ev["id"]))
                # (an event older than the window counts for nothing: a backlog read at the
                # ledger's first start must not cordon on last month's failures)
                # (a spare's or a replaced node's events are the record's, never evidence)
                if ev["node"] and ev.get("member", True) \
                        and float(ev["t"]) > now - self.cfg.window_s:
                    self._event(conn, ev, now, run_names, touched, tick)
            if len(page) < 1000:
                return

    def _event(self, conn: Connection, ev: NodeEventRow, now: float,
               run_names: dict[int, str], touched: dict[tuple[str, int | None], bool],
               tick: LedgerTick) -> None:
        node = str(ev["node"])
        details = ev["details"] or {}
        base = {"event_id": ev["id"], "reported_at": ev["t"]}
        found: Found | None = None
        if ev["name"] == PREFLIGHT_EVENT:
            passed = node_health.preflight_result(details)
            if passed is None:
                return
            failed = details.get("failed")
            checks = details.get("checks")
            checks = checks if isinstance(checks, list) else []
            detail = {**base, "failed": failed, "checks": checks[:50]}
            if passed:
                found = Found(node, EvidenceKind.PREFLIGHT_PASSED,
                              {**detail, "what": "passed a preflight"})
            else:
                what = f"failed a preflight ({failed})" if failed else "failed a preflight"
                found = Found(node, EvidenceKind.PREFLIGHT_FAILED, {**detail, "what": what})
        elif node_health.disk_fault(str(ev["message"] or ""), details.get("reason")):
            found = Found(node, EvidenceKind.DISK_ERROR,
                          {**base, "path": details.get("path"),
                           "what": f"checkpoint save failed: {ev['message'][:200]}"})
        if found is None:
            return
        # Dated when the supervisor learned of it: an agent's clock may be far off.
        trusted = ev.get("host_trusted") is not False
        new = self._record(conn, found, run_id=ev["run_id"], attempt=ev["attempt"], t=now,
                           source=f"event:{ev['id']}", run_names=run_names, touched=touched,
                           tick=tick, trusted=trusted)
        if new is not None and found.kind == EvidenceKind.PREFLIGHT_PASSED and trusted:
            host = hosts.get_host(conn, node=node)
            if host is not None and host["state"] == HostState.PROBATION:
                decision = policy.on_preflight_passed(
                    node, state=host["state"], since=float(host["since"]),
                    ran_at=float(ev["t"]), run_id=ev["run_id"], evidence_ids=(new,))
                self._apply(conn, decision, now, tick)

    def _gpus(self, conn: Connection, now: float, run_names: dict[int, str],
              touched: dict[tuple[str, int | None], bool], tick: LedgerTick) -> None:
        # A trusted agent's counters are kept with the host (the newest reading of the node
        # wins); an untrusted agent's with the agent, so it can neither raise nor reset the
        # host's.
        seen = hosts.gpu_counters(conn)
        newest = {g["node"]: g for g in hosts.gpu_readings(conn) if g["trusted"]}
        untrusted = [g for g in hosts.gpu_readings(conn) if not g["trusted"]]
        for g in [*(newest[n] for n in sorted(newest)), *untrusted]:
            before = seen.get(g["node"], {}) if g["trusted"] else g["counters"]
            found, kept = node_health.gpu_evidence(g["gpus"], before)
            if kept != before:
                if g["trusted"]:
                    hosts.set_gpu_counters(conn, node=g["node"], counters=kept, now=now)
                else:
                    hosts.set_agent_gpu_counters(conn, agent_id=g["agent_id"], counters=kept)
            for kind, detail in found:
                # (no source: the counters kept make it once)
                self._record(conn, Found(g["node"], kind, detail), run_id=g["run_id"],
                             attempt=g["attempt"], t=now, source=None, run_names=run_names,
                             touched=touched, tick=tick, trusted=g["trusted"])

    # -- decisions -----------------------------------------------------------------------------

    def _judge(self, conn: Connection, node: str, run_id: int | None, now: float,
               tick: LedgerTick) -> None:
        host = hosts.get_host(conn, node=node)
        if host is None:
            return
        cleared = host["cleared_at"]
        since = now - self.cfg.window_s if cleared is None else max(now - self.cfg.window_s,
                                                                    float(cleared))
        evidence = [node_health.Evidence(id=e["id"], kind=e["kind"], t=float(e["t"]),
                                         attempt=e["attempt"], detail=e["detail"])
                    for e in hosts.evidence(conn, node=node, since=since)]
        decision = policy.on_host_evidence(node, state=host["state"], cleared_at=cleared,
                                           evidence=evidence, now=now, cfg=self.cfg,
                                           run_id=run_id)
        self._apply(conn, decision, now, tick)

    def _judge_in_run(self, conn: Connection, node: str, run_id: int, now: float,
                      tick: LedgerTick) -> None:
        """The rule over one run's own evidence against ``node`` (from a source not trusted
        for the host): a cordon in that run only."""
        here = hosts.run_cordons(conn, run_id=run_id)
        evidence = [node_health.Evidence(id=e["id"], kind=e["kind"], t=float(e["t"]),
                                         attempt=e["attempt"], detail=e["detail"])
                    for e in hosts.evidence(conn, node=node, since=now - self.cfg.window_s,
                                            run_id=run_id)]
        decision = policy.on_host_evidence(
            node, state=HostState.CORDONED if node in here else HostState.HEALTHY,
            cleared_at=None, evidence=evidence, now=now, cfg=self.cfg, run_id=run_id,
            in_run_only=True)
        self._apply(conn, decision, now, tick)

    @staticmethod
    def _apply(conn: Connection, decision: policy.HostDecision, now: float,
               tick: LedgerTick) -> None:
        if isinstance(decision, policy.Note):
            return
        log.warning("%s", decision)
        actions.apply_host(conn, decision=decision, now=now)
        tick.decisions.append(decision)

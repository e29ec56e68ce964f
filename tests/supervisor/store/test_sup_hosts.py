"""The health ledger's store (``store.hosts``) on SQLite and Postgres: evidence recorded once
per source, the states and their conditional changes, the audit trail, the hosts list."""

from __future__ import annotations

import pytest

from tests.supervisor.sup_helpers import count_rows
from trainwarden.supervisor.enums import EvidenceKind, HostActionKind, HostState
from trainwarden.supervisor.store import hosts
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.hosts import HostStateError
from trainwarden.supervisor.store.tables import agents, runs

T = 1_000_000.0


def _run_with_agent(db: Database, node: str = "n1") -> int:
    with db.write() as c:
        run_id = int(c.execute(runs.insert().values(
            name="r1", uuid="u1", status="running", attempt=0, restarts=0, reason="",
            created_at=T, updated_at=T).returning(runs.c.id)).scalar_one())
        c.execute(agents.insert().values(run_id=run_id, node=node, registered_at=T - 50,
                                         last_seen_at=T, command=[]))
    return run_id


def test_evidence_is_recorded_once_per_source(db: Database) -> None:
    run_id = _run_with_agent(db)
    with db.write() as c:
        first = hosts.record_evidence_once(
            c, node="n1", kind=EvidenceKind.INFRA_FAILURE, run_id=run_id, attempt=2, t=T,
            detail={"what": "crash", "loss": float("nan")}, source="incident:7")
        again = hosts.record_evidence_once(
            c, node="n1", kind=EvidenceKind.INFRA_FAILURE, run_id=run_id, attempt=2, t=T + 5,
            detail={"what": "crash"}, source="incident:7")
        assert first is not None and again is None
        assert hosts.record_evidence(c, node="n1", kind=EvidenceKind.INFRA_FAILURE,
                                     run_id=run_id, attempt=2, t=T, detail={},
                                     source="incident:7") == first
        # the same source against another node is that node's
        other = hosts.record_evidence(c, node="n2", kind=EvidenceKind.HANG_CULPRIT,
                                      run_id=None, attempt=None, t=T, detail={},
                                      source="incident:7")
        # no source: never deduplicated
        ecc = [hosts.record_evidence(c, node="n1", kind=EvidenceKind.ECC, run_id=None,
                                     attempt=None, t=T + i, detail={"count": 1}) for i in (1, 2)]
        assert len({first, other, *ecc}) == 4
        assert count_rows(c, "host_evidence") == 4
        rows = hosts.evidence(c, node="n1")
        assert [r["id"] for r in rows] == [first, *ecc]  # oldest first
        assert rows[0]["detail"] == {"what": "crash", "loss": "nan"}
        assert [r["id"] for r in hosts.evidence(c, node="n1", since=T + 1)] == ecc
        assert [r["id"] for r in hosts.evidence(c, node="n1", limit=1)] == [ecc[-1]]
        # evidence makes the node known, healthy
        assert hosts.host_states(c)["n2"]["state"] == HostState.HEALTHY


def test_cordon_uncordon_and_probation_are_audited_and_conditional(db: Database) -> None:
    with db.write() as c:
        e = hosts.record_evidence(c, node="n1", kind=EvidenceKind.ECC, run_id=None,
                                  attempt=None, t=T, detail={})
        a1 = hosts.cordon(c, node="n1", reason="ECC on GPU 3", actor="policy", now=T + 1,
                          evidence_ids=[e])
        # a node never seen may be cordoned before its agent registers
        hosts.cordon(c, node="spare-9", reason="bad fan", actor="operator", now=T + 2)
        assert hosts.cordoned_nodes(c) == {"n1", "spare-9"}
        with pytest.raises(HostStateError, match="cordoned already"):
            hosts.cordon(c, node="n1", reason="again", actor="operator", now=T + 3)
        with pytest.raises(HostStateError, match="is not cordoned"):
            hosts.uncordon(c, node="n7", reason="?", actor="operator", now=T + 3)
        assert hosts.get_host(c, node="n7") is None  # a refused change writes nothing
        assert not hosts.preflight_passed(c, node="n1", now=T + 3, run_id=None)
        a2 = hosts.uncordon(c, node="n1", reason="GPU replaced", actor="operator:ci",
                            now=T + 10)
        h = hosts.get_host(c, node="n1")
        assert h is not None
        assert (h["state"], h["actor"], h["since"], h["cleared_at"]) == (
            HostState.PROBATION, "operator:ci", T + 10, T + 10)
        assert hosts.probation_nodes(c) == {"n1"} and hosts.cordoned_nodes(c) == {"spare-9"}
        assert hosts.preflight_passed(c, node="n1", now=T + 20, run_id=None,
                                      evidence_ids=[e])
        assert not hosts.preflight_passed(c, node="n1", now=T + 21, run_id=None)
        h = hosts.get_host(c, node="n1")
        assert h is not None and (h["state"], h["actor"]) == (HostState.HEALTHY, "policy")
        acts = hosts.host_actions(c, "n1")
        assert [(a["kind"], a["actor"]) for a in acts] == [
            (HostActionKind.PROBATION_PASSED, "policy"), (HostActionKind.UNCORDON, "operator:ci"),
            (HostActionKind.CORDON, "policy")]
        assert acts[-1]["id"] == a1 and acts[-1]["evidence_ids"] == [e]
        assert acts[-1]["reason"] == "ECC on GPU 3" and acts[1]["id"] == a2
        assert len(hosts.host_actions(c)) == 4


def test_the_hosts_list_holds_every_known_node(db: Database) -> None:
    run_id = _run_with_agent(db, node="agent-only")
    with db.write() as c:
        hosts.record_evidence(c, node="n1", kind=EvidenceKind.INFRA_FAILURE, run_id=run_id,
                              attempt=0, t=T - 2 * 86400, detail={"what": "old crash"})
        newest = hosts.record_evidence(c, node="n1", kind=EvidenceKind.INFRA_FAILURE,
                                       run_id=run_id, attempt=1, t=T, detail={"what": "crash"})
        hosts.record_evidence(c, node="n1", kind=EvidenceKind.PREFLIGHT_PASSED, run_id=run_id,
                              attempt=1, t=T + 1, detail={})
        hosts.cordon(c, node="n1", reason="two crashes", actor="policy", now=T + 2)
    with db.read() as c:
        listed = {h["node"]: h for h in hosts.host_summaries(c, since=T - 86400)}
    assert sorted(listed) == ["agent-only", "n1"]
    assert listed["agent-only"]["state"] == HostState.HEALTHY
    assert listed["agent-only"]["since"] == T - 50 and listed["agent-only"]["evidence_count"] == 0
    assert listed["agent-only"]["latest_evidence"] is None
    n1 = listed["n1"]
    assert (n1["state"], n1["reason"], n1["evidence_count"]) == (HostState.CORDONED,
                                                                  "two crashes", 1)
    assert n1["latest_evidence"] is not None and n1["latest_evidence"]["id"] == newest


def test_gpu_counters_are_kept_per_node(db: Database) -> None:
    with db.write() as c:
        hosts.set_gpu_counters(c, node="n1", counters={"ecc": {"0": 2}}, now=T)
        assert hosts.gpu_counters(c) == {"n1": {"ecc": {"0": 2}}}
        hosts.set_gpu_counters(c, node="n1", counters={"ecc": {"0": 3}, "xid": {}}, now=T)
        assert hosts.gpu_counters(c)["n1"] == {"ecc": {"0": 3}, "xid": {}}

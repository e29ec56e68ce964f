"""Silent data corruption that comes back, on SQLite and Postgres, through the real app: the
first mismatch is rolled back; the second on the same node within the window cordons the
node (``cordon.sdc``), and with no free spare to take its rank the run is stopped, saying
which cordon and which checkpoint to resume from, instead of a third rollback on a machine
known to corrupt.  A member cordoned for silent data corruption never keeps its rank."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import OPERATOR, FakeClock, ingest, register, step
from trainwarden.supervisor.control import membership
from trainwarden.supervisor.control.evaluator import Evaluator


def mismatch(attempt: int, rank: int, corrupt: int) -> dict[str, Any]:
    """A majority rank's report: rank ``corrupt`` disagrees at step 200 (agreed at 150)."""
    return {"type": "event", "attempt": attempt, "rank": rank, "t": 300.0 + attempt,
            "step": 200, "name": "replica_mismatch", "message": "replicas disagree",
            "details": {"corrupt": [corrupt], "suspects": [], "replicas": 3,
                        "first_disagreement": 200, "last_agreed_step": 150}}


def train(attempt: int, ranks: list[int], steps: range) -> list[dict[str, Any]]:
    return [step(r, s, attempt=attempt, world_size=4) for s in steps for r in ranks]


def checkpoints(*at: int) -> list[dict[str, Any]]:
    return [{"type": "checkpoint", "step": s, "path": f"/ck/step_{s}", "bytes": 5,
             "t": 100.0 + s, "lineage": "a0", "save_s": 0.1} for s in at]


@pytest.mark.parametrize("nodes", [1, 2])
def test_corruption_again_on_the_same_node_cordons_it_and_stops_the_run_without_a_spare(
        client: TestClient, clock: FakeClock, evaluator: Evaluator, nodes: int) -> None:
    """One node (a standalone run), or two nodes with the corrupt rank on the second; no
    spare either way."""
    run = f"sdc-again-{nodes}"
    names = ["gpu-40", "gpu-41"][:nodes]
    agents = [register(client, run=run, node=n, nnodes=nodes)["agent_id"] for n in names]
    ranks = {a: [2 * k, 2 * k + 1] for k, a in enumerate(agents)}
    bad = names[-1]
    corrupt = ranks[agents[-1]][-1]
    seq = dict.fromkeys(agents, 0)

    def send(a: int, attempt: int, items: list[dict[str, Any]]) -> None:
        ingest(client, a, seq[a], items, attempt=attempt)
        seq[a] += 1

    for a in agents:
        send(a, 0, train(0, ranks[a], range(0, 210, 5)))
    send(agents[0], 0, checkpoints(100, 150, 200))
    send(agents[0], 0, [mismatch(0, 0, corrupt)])
    evaluator.tick()
    (first,) = client.get(f"/api/v1/runs/{run}/actions", headers=OPERATOR).json()["actions"]
    assert first["cause"] == "sdc" and first["plan"]["checkpoint"] == "/ck/step_150", first
    assert client.get(f"/api/v1/hosts/{bad}", headers=OPERATOR).json()["state"] == "healthy"

    # The rollback resumes and the same node corrupts again.
    for a in agents:
        send(a, 1, train(1, ranks[a], range(151, 205, 3)))
    clock.advance(30)
    evaluator.tick()
    send(agents[0], 1, [mismatch(1, 0, corrupt)])
    clock.advance(1)
    evaluator.tick()
    evaluator.tick()

    host = client.get(f"/api/v1/hosts/{bad}", headers=OPERATOR).json()
    assert host["state"] == "cordoned" and host["reason"].startswith("cordon.sdc: "), host
    r = client.get(f"/api/v1/runs/{run}", headers=OPERATOR).json()
    assert r["status"] == "failed", r
    assert f"{bad} is cordoned for silent data corruption (cordon.sdc: " in r["reason"], r
    assert "no free spare" in r["reason"] and "/ck/step_150" in r["reason"], r
    acts = sorted(client.get(f"/api/v1/runs/{run}/actions", headers=OPERATOR).json()["actions"],
                  key=lambda x: x["id"])
    # Rolled back once; the second rollback, decided before the cordon, never reached an agent.
    assert [(x["kind"], x["status"]) for x in acts] == [
        ("restart", "resumed"), ("restart", "superseded"), ("stop", acts[2]["status"])], acts
    incidents = client.get(f"/api/v1/runs/{run}/incidents", headers=OPERATOR).json()["incidents"]
    assert [(i["kind"], i["node"]) for i in incidents] == [
        ("silent_data_corruption", bad)] * 2, incidents


def test_a_member_cordoned_for_silent_data_corruption_never_keeps_its_rank() -> None:
    """Without a free spare a cordoned member keeps its rank (a suspect node runs rather than
    none), unless it was cordoned for silent data corruption: its rank waits for a node."""
    facts = membership.MembershipFacts(
        nnodes=2, epoch=1, members={0: "a", 1: "b"}, live=frozenset({"a", "b"}), spares=(),
        cordoned=frozenset({"b"}))
    assert membership.plan_members(facts).kept_cordoned == {1: "b"}
    plan = membership.plan_members(
        membership.MembershipFacts(**{**facts.__dict__, "corrupting": frozenset({"b"})}))
    assert plan.kept_cordoned == {} and plan.waiting == (1,), plan
    assert "node rank 1 waits for a node (b cordoned for silent data corruption" \
        in plan.summary(), plan.summary()
    # A free spare takes it; a run that may shrink leaves it out.
    spare = membership.plan_members(membership.MembershipFacts(
        **{**facts.__dict__, "corrupting": frozenset({"b"}), "spares": ("s",),
           "live": frozenset({"a", "b", "s"})}))
    assert spare.replaced == (membership.Replacement(1, "b", "s", membership.CORRUPTING),)
    assert "s takes node rank 1 of b (cordoned for silent data corruption)" in spare.summary()
    shrunk = membership.plan_members(membership.MembershipFacts(
        **{**facts.__dict__, "corrupting": frozenset({"b"}), "min_nodes": 1}), shrink=True)
    assert shrunk.members == {0: "a"} and shrunk.dropped == (
        membership.Dropped(1, "b", membership.CORRUPTING),), shrunk

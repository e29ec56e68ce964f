"""A run that accepts fewer nodes (``--min-nodes``): without a free spare it shrinks to the
members fit to run instead of waiting, and grows back to its declared world at the first
checkpoint after a node is free again.  The pure plan (``control.membership``), then the
evaluator and the store."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    OPERATOR,
    FakeClock,
    ingest,
    register,
    step,
)
from trainwarden.supervisor.cli.client import _nodes_cell
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.membership import (
    Dropped,
    MembershipFacts,
    Replacement,
    can_shrink,
    plan_members,
)

LIVE = frozenset({"n0", "n1", "n2", "s0"})


def facts(**kw: Any) -> MembershipFacts:
    base: dict[str, Any] = {"nnodes": 3, "epoch": 2, "members": {0: "n0", 1: "n1", 2: "n2"},
                            "live": LIVE, "spares": [], "min_nodes": 1}
    base.update(kw)
    return MembershipFacts(**base)


def test_a_lost_member_without_a_spare_shrinks_the_world_keeping_the_others_order() -> None:
    p = plan_members(facts(live=LIVE - {"n1"}), shrink=True)
    assert p.members == {0: "n0", 1: "n2"} and p.nnodes == 2 and p.full == 3
    assert p.epoch == 3 and p.waiting == () and p.resized
    assert p.dropped == (Dropped(node_rank=1, node="n1", why="lost"),)
    assert p.summary() == ("the world shrinks from 3 to 2 of 3 nodes; "
                           "n1 (node rank 1, lost) is left out")
    assert p.wire("h:1")["nnodes"] == 2 and p.wire("h:1")["declared"] == 3


def test_a_shrink_never_goes_below_min_nodes_and_a_spare_comes_first() -> None:
    p = plan_members(facts(live=frozenset({"n0"}), min_nodes=2), shrink=True)
    assert p.nnodes == 3 and p.waiting == (1, 2) and p.dropped == ()  # it waits
    p = plan_members(facts(live=LIVE - {"n1"}, spares=["s0"]), shrink=True)
    assert p.members == {0: "n0", 1: "s0", 2: "n2"} and p.nnodes == 3 and not p.resized
    # a cordoned member is left out too (no spare to replace it)
    p = plan_members(facts(cordoned=frozenset({"n0"})), shrink=True)
    assert p.members == {0: "n1", 1: "n2"}
    assert p.dropped == (Dropped(node_rank=0, node="n0", why="cordoned"),)
    # without shrink, the same facts wait as a run without --min-nodes does
    assert plan_members(facts(live=LIVE - {"n1"})).waiting == (1,)


def test_a_shrunk_world_grows_back_only_when_asked_and_only_with_free_nodes() -> None:
    shrunk = facts(members={0: "n0", 1: "n2"}, world=2, spares=["n1"])
    assert plan_members(shrunk).members == {0: "n0", 1: "n2"}
    assert plan_members(shrunk).nnodes == 2
    p = plan_members(shrunk, grow=True)
    assert p.members == {0: "n0", 1: "n2", 2: "n1"} and p.nnodes == 3 and p.epoch == 3
    assert p.replaced == (Replacement(node_rank=2, old=None, new="n1", why="grow"),)
    assert p.summary() == "the world grows back from 2 to 3 of 3 nodes; n1 takes node rank 2 (grow)"
    assert plan_members(facts(members={0: "n0", 1: "n2"}, world=2, spares=["n1"],
                              live=LIVE - {"n1"}), grow=True).nnodes == 2  # n1 silent
    assert can_shrink(shrunk) and not can_shrink(facts(min_nodes=None))
    assert not can_shrink(facts(min_nodes=3))


def test_the_policy_shrinks_only_within_min_nodes_by_the_training_each_option_loses() -> None:
    figures = policy.ElasticFigures(step_s=0.5, restart_s=10.0, interval_s=20.0)
    c = policy.choose_shrink(declared=2, world=2, fit=1, min_nodes=1, figures=figures)
    # an unknown return (4 h) waited for loses far more than a shrink and a grow back
    assert c.shrink and c.reason.startswith("no spare is free: shrink on 1 of 2 nodes: "), c
    assert "return time unknown" in c.reason and "assumed" not in c.reason
    c = policy.choose_shrink(declared=2, world=2, fit=1, min_nodes=1)
    assert c.shrink and "assumed: step, restart, checkpoint interval time" in c.reason
    c = policy.choose_shrink(declared=3, world=3, fit=1, min_nodes=2, figures=figures)
    assert not c.shrink and "fewer than the 2" in c.reason
    assert not policy.choose_shrink(declared=2, world=2, fit=1, min_nodes=None).shrink


# -- through the evaluator and the store ----------------------------------------------------


def get(client: TestClient, path: str) -> Any:
    r = client.get(f"/api/v1/runs/r1{path}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def checkpoint(step_: int, attempt: int = 0) -> dict[str, Any]:
    return {"type": "checkpoint", "step": step_, "path": f"/ck/{step_}", "bytes": 5,
            "t": 10.0 + step_, "lineage": f"a{attempt}", "attempt": attempt}


def start(client: TestClient) -> dict[str, int]:
    ids = {n: register(client, node=n, min_nodes=1)["agent_id"] for n in ("n0", "n1")}
    ingest(client, ids["n0"], 0, [step(0, 0), checkpoint(1)])
    ingest(client, ids["n1"], 0, [step(1, 0)])
    return ids


def test_min_nodes_beyond_the_declared_world_is_refused_and_changes_nothing(
        client: TestClient) -> None:
    r = register(client, node="n0", min_nodes=3, expect=422)
    assert "--min-nodes 3" in r["detail"] and "from 1 to 2" in r["detail"], r
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).status_code in (404, 200)
    ok = register(client, node="n0", min_nodes=2)
    assert ok["membership"]["nnodes"] == 2 and ok["membership"]["declared"] == 2


def test_a_lost_member_without_a_spare_shrinks_the_run_then_it_grows_back_at_a_checkpoint(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    ids = start(client)
    evaluator.tick()
    clock.advance(40)  # past the node-lost deadline: n1 silent
    ingest(client, ids["n0"], 1, [])
    evaluator.tick()
    (act,) = get(client, "/actions")["actions"]
    assert act["cause"] == "node_lost"
    assert "the world shrinks from 2 to 1 of 2 nodes" in act["reason"], act["reason"]
    assert "no spare is free: shrink on 1 of 2 nodes" in act["reason"]
    m = act["plan"]["membership"]
    assert m["members"] == {"n0": 0} and m["nnodes"] == 1 and m["declared"] == 2
    assert m["waiting"] == [] and m["epoch"] == 1
    run = get(client, "")
    assert run["membership"]["world"] == 1 and run["membership"]["nnodes"] == 2
    assert run["membership"]["missing"] == []
    resized = [e for e in get(client, "/events")["events"] if e["name"] == "world_resized"]
    assert [(e["details"]["from"], e["details"]["to"]) for e in resized] == [(2, 1)]
    # shown: the page, /metrics and the CLI's NODES cell say the world against the declared
    page = client.get("/runs/r1", headers=OPERATOR).text
    assert 'id="world-shrunk">1 of 2 declared nodes' in page and "(accepts 1)" in page
    metrics = client.get("/metrics", headers=OPERATOR).text
    assert 'trainwarden_run_world_nodes{run="r1"} 1.0' in metrics
    assert 'trainwarden_run_declared_nodes{run="r1"} 2.0' in metrics
    assert _nodes_cell(run).endswith(" SHRUNK"), _nodes_cell(run)
    # the survivor takes the restart and trains attempt 1 on one node
    assert [c["kind"] for c in ingest(client, ids["n0"], 2, [])["commands"]] == ["restart"]
    t = clock.now
    ingest(client, ids["n0"], 3, [step(0, 1, attempt=1, t=t + 1), step(0, 2, attempt=1, t=t + 2)],
           attempt=1)
    clock.advance(3)
    evaluator.tick()
    assert get(client, "")["status"] == "running"
    # the goodput counts the shrunk steps (one rank of the two is all they have), and half
    # of each one's 0.25 s as capacity lost: the full world would have taken 0.125 s
    assert get(client, "")["goodput"]["badput_s"]["capacity"] == pytest.approx(2 * 0.125)
    # the lost node comes back (a new agent process on it): a spare, not a member yet
    back = register(client, node="n1", min_nodes=1)
    assert back["membership"]["role"] == "spare", back
    evaluator.tick()
    planned = [e for e in get(client, "/events")["events"] if e["name"] == "grow_planned"]
    assert len(planned) == 1 and planned[0]["details"]["after_step"] == 2, planned
    assert len(get(client, "/actions")["actions"]) == 1  # no restart before a checkpoint
    evaluator.tick()
    assert len(get(client, "/actions")["actions"]) == 1
    # the next checkpoint: the gang restarts from it on both nodes
    ingest(client, ids["n0"], 4, [step(0, 3, attempt=1), checkpoint(4, attempt=1)],
           attempt=1)
    ingest(client, back["agent_id"], back["next_seq"], [], attempt=1)
    evaluator.tick()
    acts = sorted(get(client, "/actions")["actions"], key=lambda a: a["id"])
    assert len(acts) == 2, acts
    grow = acts[1]
    assert grow["cause"] == "grow" and grow["plan"]["checkpoint"] == "/ck/4"
    assert "grow back from 1 to 2 nodes at the checkpoint of step 4" in grow["reason"]
    assert grow["plan"]["membership"]["members"] == {"n0": 0, "n1": 1}
    assert grow["plan"]["membership"]["nnodes"] == 2
    run = get(client, "")
    assert run["membership"]["world"] == 2
    assert run["restarts_by_cause"]["grow"] == 1 and run["restarts_by_cause"]["node_lost"] == 1
    # decided once: the next ticks find the world whole
    evaluator.tick()
    assert len(get(client, "/actions")["actions"]) == 2


def test_without_min_nodes_the_run_waits_as_before(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    ids = {n: register(client, node=n)["agent_id"] for n in ("n0", "n1")}
    ingest(client, ids["n0"], 0, [step(0, 0), checkpoint(1)])
    evaluator.tick()
    clock.advance(40)
    ingest(client, ids["n0"], 1, [])
    evaluator.tick()
    (act,) = get(client, "/actions")["actions"]
    assert act["plan"]["membership"]["waiting"] == [1]
    assert act["plan"]["membership"]["nnodes"] == 2
    assert "shrink" not in act["reason"]

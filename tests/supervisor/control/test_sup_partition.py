"""A network partition named by the failed rendezvous after it: the detector reads a
member's torchrun that could not reach the rendezvous host's store (and the host's that gave
up on its members); the policy names the member cut off while the host is heard, replaces
it once (counted against no budget, bounded by the no-progress rule), and holds the host's
own failure for the member's report.  The membership gives the cut-off member's rank to a
spare, or makes it wait, saying why.  Pure: the exact messages torch 2.13 prints."""

from __future__ import annotations

from typing import Any

import pytest

from tests.supervisor.control.test_sup_node_death import Nodes, beat
from tests.supervisor.sup_helpers import OPERATOR, step
from trainwarden.agent.core import rootcause
from trainwarden.agent.core.rootcause import RootCause
from trainwarden.supervisor.control import membership, policy
from trainwarden.supervisor.detect import partition
from trainwarden.supervisor.enums import IncidentKind, RestartCause, Verdict

UNREACHED = ("The client socket has failed to connect to any network address of "
             "(10.231.0.2, 31196). The client socket has failed to connect to "
             "35.86.0.0:5796 (errno: 113 - No route to host).")
NOT_JOINED = "Timed out after 16 seconds waiting for clients. 1/2 clients joined."
RESET = "[gloo/transport/tcp/pair.cc:534] Read error [10.231.0.2]:29500: Connection reset by peer"
RUN = policy.RunFacts(id=1, name="r1", status="running", attempt=1, restarts=1)
CFG = policy.PolicyConfig()


def rc(exc_type: str, message: str) -> dict[str, Any]:
    return {"exc_type": exc_type, "message": message,
            "frame": {"file": "/v/torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py",
                      "line": 67, "function": "next_rendezvous"},
            "user_frame": None, "traceback": f"{exc_type}: {message}", "source": "launcher"}


def launcher_exit(node: str, root_cause: dict[str, Any], agent_id: int = 2
                  ) -> policy.ExitFacts:
    """torchrun failed before any worker ran: the agent reports the launcher's own error."""
    return policy.ExitFacts(
        id=agent_id, agent_id=agent_id, node=node, attempt=1, outcome="crashed", exit_code=1,
        signal=None, failed_ranks=[{"rank": None, "exit_code": 1, "signal": None,
                                    "launcher": True, "message": root_cause["message"],
                                    "root_cause": root_cause}])


def decide(ex: policy.ExitFacts, *, host: str | None = "node0",
           silent: dict[str, float] | None = None, may_wait: bool = True,
           recovery: policy.RecoveryFacts | None = None) -> policy.Decision:
    return policy.on_exit(RUN, ex, agent_ids=frozenset({1, 2}), completed_agent_ids=frozenset(),
                          checkpoint="/ck/step_100", cfg=CFG, now=1000.0,
                          silent_peers=silent or {}, may_wait=may_wait,
                          may_wait_for_member=may_wait, recovery=recovery,
                          rendezvous=policy.RendezvousFacts(host=host))


def as_rc(d: dict[str, Any]) -> RootCause:
    out = rootcause.from_dict(d)
    assert out is not None
    return out


def test_the_detector_reads_the_store_address_a_member_could_not_reach() -> None:
    u = partition.unreached(as_rc(rc("torch.distributed.DistNetworkError", UNREACHED)))
    assert u == partition.Unreached("10.231.0.2", 31196, "No route to host")
    assert u.endpoint == "10.231.0.2:31196"
    assert partition.unreached(as_rc(rc("RuntimeError", RESET))) is None
    assert partition.unreached(None) is None
    assert partition.not_joined(as_rc(rc("torch.distributed.DistStoreError", NOT_JOINED))) \
        == (1, 2)
    assert partition.not_joined(as_rc(rc("torch.distributed.DistNetworkError", UNREACHED))) \
        is None


def test_cut_off_needs_a_heard_host_that_is_not_the_failing_node() -> None:
    r = as_rc(rc("torch.distributed.DistNetworkError", UNREACHED))
    p = partition.cut_off("node1", r, host="node0", silent={})
    assert p == partition.Partition("node1", "node0", "10.231.0.2:31196", "No route to host")
    assert p.message.startswith("network partition: node1 cannot reach node0 (the "
                                "rendezvous host, 10.231.0.2:31196: No route to host)")
    assert partition.cut_off("node1", r, host="node0", silent={"node0": 6.0}) is None  # lost
    assert partition.cut_off("node0", r, host="node0", silent={}) is None
    assert partition.cut_off("node1", r, host=None, silent={}) is None


def test_a_member_that_cannot_reach_the_heard_host_is_cut_off_and_replaced_once() -> None:
    d = decide(launcher_exit("node1", rc("torch.distributed.DistNetworkError", UNREACHED)))
    assert isinstance(d, policy.Restart), d
    assert d.cause == RestartCause.PARTITION and d.cut_off == frozenset({"node1"})
    assert not d.counts_against_budget and d.lost == frozenset() and not d.replace_lost
    assert d.incident is not None and d.incident.kind == IncidentKind.PARTITION
    assert d.incident.node == "node1"
    assert d.incident.cause.startswith("network partition: node1 cannot reach node0")
    assert d.incident.details["partition"] == {
        "cut_off": "node1", "unreachable": "node0", "endpoint": "10.231.0.2:31196",
        "why": "No route to host"}
    assert "node1 is replaced" in d.reason
    # No budget counts it: the collective timeout before it was counted.
    assert RestartCause.PARTITION not in policy.BUDGET_CAUSES


def test_a_partition_that_a_replacement_did_not_end_stops_on_the_no_progress_rule() -> None:
    stuck = policy.RecoveryFacts(high_step=176, high_at_restarts=(176, 176, 176),
                                 restarts_by_cause={"hang": 1, "partition": 2})
    d = decide(launcher_exit("spare0", rc("torch.distributed.DistNetworkError", UNREACHED)),
               recovery=stuck)
    assert isinstance(d, policy.Stop), d
    assert d.incident is not None and d.incident.kind == IncidentKind.PARTITION
    assert "no progress: 3 restarts in a row" in d.reason
    assert "spare0 cannot reach node0" in d.reason


def test_the_hosts_own_failure_is_held_for_the_members_report_then_a_crash() -> None:
    host = launcher_exit("node0", rc("torch.distributed.DistStoreError", NOT_JOINED), 1)
    held = decide(host)
    assert isinstance(held, policy.Note) and held.verdict == Verdict.WAIT, held
    assert "formed with 1 of 2 nodes" in held.why
    late = decide(host, may_wait=False)
    assert isinstance(late, policy.Restart) and late.cause == RestartCause.CRASH, late


def test_a_silent_host_is_not_a_partition() -> None:
    d = decide(launcher_exit("node1", rc("torch.distributed.DistNetworkError", UNREACHED)),
               silent={"node0": 7.0}, may_wait=False)
    assert not (isinstance(d, policy.Restart) and d.cause == RestartCause.PARTITION), d


def test_the_cut_off_members_rank_goes_to_a_spare_or_waits_saying_why() -> None:
    facts = membership.MembershipFacts(
        nnodes=2, epoch=0, members={0: "node0", 1: "node1"},
        live=frozenset({"node0", "node1", "spare0"}), spares=["spare0"],
        cut_off=frozenset({"node1"}))
    plan = membership.plan_members(facts)
    assert plan.members == {0: "node0", 1: "spare0"} and plan.epoch == 1
    assert "spare0 takes node rank 1 of node1 (cut off)" in plan.summary()
    alone = membership.plan_members(membership.MembershipFacts(
        nnodes=2, epoch=0, members={0: "node0", 1: "node1"},
        live=frozenset({"node0", "node1"}), spares=[], cut_off=frozenset({"node1"}),
        spares_configured=False))
    assert alone.waiting == (1,) and alone.missing == {1: "node1 cut off"}
    assert "node1 cut off" in alone.summary()


# ---- through the app ---------------------------------------------------------------------------


TIMEOUT = {"exc_type": "RuntimeError",
           "message": "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms "
                      "for recv operation to complete",
           "frame": None, "user_frame": None, "source": "stderr",
           "traceback": "RuntimeError: Timed out waiting 10000ms for recv operation"}


def _exit(clock: Any, attempt: int, failed: dict[str, Any]) -> dict[str, Any]:
    return {"type": "exit", "attempt": attempt, "t": clock.now, "exit_code": 1,
            "signal": None, "outcome": "crashed", "failed_ranks": [failed]}


@pytest.mark.parametrize("member_late_s", [2, 25])
def test_the_failed_rendezvous_after_a_timeout_names_the_partition_and_folds_the_timeout(
        client: Any, clock: Any, evaluator: Any, member_late_s: int) -> None:
    """Attempt 0 ends on a collective timeout (every node heard: a crash restart on the same
    members); attempt 1's rendezvous fails: the host's torchrun first (held), then the
    member's, naming the host.  One partition incident naming the member, the timeout's
    incident resolved as its consequence, the member's rank given to the spare.  The member's
    torchrun gives up on its own rendezvous timeout, counted from its own start: on a busy
    machine its report comes well after the host's (25 s: longer than a lost peer's
    confirmation wait), and the host's failure is still held for it while it is heard."""
    nodes = Nodes(client, clock)
    for s in range(5):
        clock.advance(0.1)
        nodes.send("node0", [step(r, s, t=clock.now) for r in (0, 1)] + [beat(clock)])
        nodes.send("node1", [step(r, s, t=clock.now) for r in (2, 3)] + [beat(clock)])
        nodes.send("spare0", [beat(clock)])
    clock.advance(1.0)
    nodes.send("node1", [_exit(clock, 0, {"rank": 2, "local_rank": 0, "exit_code": 1,
                                          "signal": None, "message": TIMEOUT["message"],
                                          "root_cause": TIMEOUT}), beat(clock)])
    nodes.tick_for(evaluator, 2, alive=("node0", "node1", "spare0"))
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["attempt"] == 1, run
    host_failed = launcher_exit("node0", rc("torch.distributed.DistStoreError", NOT_JOINED))
    nodes.send("node0", [_exit(clock, 1, host_failed.failed_ranks[0]), beat(clock)])
    nodes.tick_for(evaluator, member_late_s, alive=("node0", "node1", "spare0"))
    assert client.get("/api/v1/runs/r1", headers=OPERATOR).json()["attempt"] == 1  # held
    member = launcher_exit("node1", rc("torch.distributed.DistNetworkError", UNREACHED))
    nodes.send("node1", [_exit(clock, 1, member.failed_ranks[0]), beat(clock)])
    nodes.tick_for(evaluator, 12, alive=("node0", "node1", "spare0"))
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["attempt"] == 2, run
    incidents = sorted(client.get("/api/v1/runs/r1/incidents", headers=OPERATOR).json()[
        "incidents"], key=lambda i: i["id"])
    assert [(i["kind"], i["node"]) for i in incidents] == [("crash", "node1"),
                                                          ("partition", "node1")], incidents
    first, part = incidents
    assert first["status"] == "resolved" and first["details"]["consequence_of"] == part["id"]
    assert part["details"]["consequences"] == [
        {"id": first["id"], "kind": "crash", "node": "node1"}]
    assert part["cause"].startswith("network partition: node1 cannot reach node0")
    actions = sorted(client.get("/api/v1/runs/r1/actions", headers=OPERATOR).json()["actions"],
                     key=lambda a: a["id"])
    assert [a["cause"] for a in actions] == ["crash", "partition"], actions
    assert actions[-1]["plan"]["membership"]["members"] == {"node0": 0, "spare0": 1}
    assert "spare0 takes node rank 1 of node1 (cut off)" in actions[-1]["reason"]
    restarts = run["restarts_by_cause"]
    assert {k: v for k, v in restarts.items() if v} == {"crash": 1, "partition": 1}, restarts

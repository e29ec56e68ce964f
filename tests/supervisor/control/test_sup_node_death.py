"""A node's death confirmed in seconds: a survivor's failure on a lost peer connection, read
with a member's silence, is that member's death: one node-lost incident naming it (the
survivor's error quoted as its consequence), one restart that gives its rank to a spare, and
no crash of the survivor.  Silence alone waits for the deadline; a peer-loss failure with no
silent peer is an ordinary crash after a short hold.  The rule pure, then through ingest, the
store and the evaluator on SQLite and Postgres."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import OPERATOR, FakeClock, ingest, register, step
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.detect.node_lost import NodeLostConfig, silent_members
from trainwarden.supervisor.enums import IncidentKind, RestartCause, Verdict

RESET = {"exc_type": "RuntimeError",
         "message": "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
                    "[127.0.0.1]:29500: Connection reset by peer",
         "frame": None, "user_frame": None, "traceback": "RuntimeError: Connection reset by "
                                                          "peer", "source": "stderr"}
KEYERROR = {"exc_type": "KeyError", "message": "'label'",
            "frame": {"file": "/u/train.py", "line": 5, "function": "f"},
            "user_frame": {"file": "/u/train.py", "line": 5, "function": "f"},
            "traceback": "KeyError: 'label'", "source": "stderr"}
RUN = policy.RunFacts(id=1, name="r1", status="running", attempt=0, restarts=0)
CFG = policy.PolicyConfig()


def failed(root_cause: dict[str, Any], rank: int = 0) -> dict[str, Any]:
    return {"rank": rank, "local_rank": 0, "exit_code": 1, "signal": None, "pid": 10,
            "message": root_cause["message"], "root_cause": root_cause}


def exit_facts(root_cause: dict[str, Any]) -> policy.ExitFacts:
    return policy.ExitFacts(id=1, agent_id=1, node="node0", attempt=0, outcome="crashed",
                            exit_code=1, signal=None, failed_ranks=[failed(root_cause)],
                            rank_steps={0: 40, 1: 40})


def decide(root_cause: dict[str, Any], silent: dict[str, float], may_wait: bool
           ) -> policy.Decision:
    return policy.on_exit(RUN, exit_facts(root_cause), agent_ids=frozenset({1, 2}),
                          completed_agent_ids=frozenset(), checkpoint="/ck/step_20", cfg=CFG,
                          now=1000.0, silent_peers=silent, may_wait=may_wait)


def test_a_survivors_lost_connection_and_a_silent_peer_are_that_peers_death() -> None:
    d = decide(RESET, {"node1": 6.2}, may_wait=True)
    assert isinstance(d, policy.Restart), d
    assert d.cause == RestartCause.NODE_LOST and d.lost == frozenset({"node1"})
    assert d.replace_lost and d.counts_against_budget
    assert d.incident is not None and d.incident.kind == IncidentKind.NODE_LOST
    assert d.incident.node == "node1" and d.incident.rank is None
    assert d.incident.cause.startswith("node node1 lost: node1 silent for 6.2 s")
    assert "Connection reset by peer" in d.incident.cause  # the survivor's, as its consequence
    assert d.incident.details["survivor"]["node"] == "node0"


def test_a_lost_connection_with_no_silent_peer_is_held_then_a_crash() -> None:
    held = decide(RESET, {}, may_wait=True)
    assert isinstance(held, policy.Note) and held.verdict == Verdict.WAIT
    crash = decide(RESET, {}, may_wait=False)
    assert isinstance(crash, policy.Restart) and crash.cause == RestartCause.CRASH
    assert crash.lost == frozenset()


def test_silence_alone_confirms_nothing() -> None:
    """A crash of the script's own, while a peer is briefly silent, is the script's crash."""
    d = decide(KEYERROR, {"node1": 6.0}, may_wait=True)
    assert isinstance(d, policy.Restart) and d.cause == RestartCause.CRASH and not d.lost


def test_silent_members_counts_from_the_confirmation_time() -> None:
    cfg = NodeLostConfig(confirm_s=5.0)
    beats = {"a": 100.0, "b": 96.0, "c": 94.9}
    assert silent_members(beats, 100.0, cfg) == {"c": 5.1}
    # A supervisor that just came back has not watched long enough to tell.
    assert silent_members(beats, 100.0, cfg, observing_since=98.0) == {}


# ---- through the app ---------------------------------------------------------------------------


def beat(clock: FakeClock) -> dict[str, Any]:
    return {"type": "heartbeat", "t": clock.now, "state": "running"}


def survivor_exit(clock: FakeClock) -> dict[str, Any]:
    return {"type": "exit", "attempt": 0, "t": clock.now, "exit_code": 1, "signal": None,
            "outcome": "crashed", "failed_ranks": [failed(RESET, rank=0)]}


class Nodes:
    def __init__(self, client: TestClient, clock: FakeClock) -> None:
        self.client, self.clock = client, clock
        self.ids = {n: register(client, node=n, spare=(n == "spare0"))["agent_id"]
                    for n in ("node0", "node1", "spare0")}
        self.seq = dict.fromkeys(self.ids, 0)

    def send(self, node: str, items: list[dict[str, Any]]) -> None:
        ingest(self.client, self.ids[node], self.seq[node], items)
        self.seq[node] += 1

    def tick_for(self, evaluator: Evaluator, seconds: float, alive: tuple[str, ...]) -> None:
        """``seconds`` of heartbeats from ``alive`` (one a second), a tick after each."""
        for _ in range(int(seconds)):
            self.clock.advance(1.0)
            for n in alive:
                self.send(n, [beat(self.clock)])
            evaluator.tick()


def test_a_killed_node_is_lost_in_seconds_with_one_restart_and_no_survivor_blamed(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    nodes = Nodes(client, clock)
    for s in range(20):
        clock.advance(0.1)
        nodes.send("node0", [step(r, s, t=clock.now) for r in (0, 1)] + [beat(clock)])
        nodes.send("node1", [step(r, s, t=clock.now) for r in (2, 3)] + [beat(clock)])
        nodes.send("spare0", [beat(clock)])
    evaluator.tick()
    # node1 dies (no more heartbeats); a second later node0's workers fail on the connection.
    clock.advance(1.0)
    nodes.send("node0", [survivor_exit(clock), beat(clock)])
    nodes.send("spare0", [beat(clock)])
    evaluator.tick()
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["attempt"] == 0 and run["status"] == "running", run  # held: not yet confirmed
    nodes.tick_for(evaluator, 6, alive=("node0", "spare0"))
    run = client.get("/api/v1/runs/r1", headers=OPERATOR).json()
    assert run["attempt"] == 1 and run["status"] == "restarting", run
    incidents = client.get("/api/v1/runs/r1/incidents", headers=OPERATOR).json()["incidents"]
    assert [(i["kind"], i["node"]) for i in incidents] == [("node_lost", "node1")], incidents
    actions = client.get("/api/v1/runs/r1/actions", headers=OPERATOR).json()["actions"]
    assert [a["cause"] for a in actions] == ["node_lost"], actions
    assert actions[0]["plan"]["membership"]["members"] == {"node0": 0, "spare0": 1}
    # The deadline passing later adds nothing: still one incident, one restart.
    nodes.tick_for(evaluator, 35, alive=("node0", "spare0"))
    incidents = client.get("/api/v1/runs/r1/incidents", headers=OPERATOR).json()["incidents"]
    assert [i["kind"] for i in incidents] == ["node_lost"], incidents
    restarts = client.get("/api/v1/runs/r1", headers=OPERATOR).json()["restarts_by_cause"]
    assert {k: v for k, v in restarts.items() if v} == {"node_lost": 1}, restarts


def test_a_lost_connection_with_every_peer_heard_is_a_crash_after_the_hold(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    nodes = Nodes(client, clock)
    for s in range(5):
        clock.advance(0.1)
        nodes.send("node0", [step(r, s, t=clock.now) for r in (0, 1)] + [beat(clock)])
        nodes.send("node1", [step(r, s, t=clock.now) for r in (2, 3)] + [beat(clock)])
    clock.advance(0.5)
    nodes.send("node0", [survivor_exit(clock), beat(clock)])
    evaluator.tick()
    nodes.tick_for(evaluator, 12, alive=("node0", "node1", "spare0"))
    incidents = client.get("/api/v1/runs/r1/incidents", headers=OPERATOR).json()["incidents"]
    assert [(i["kind"], i["node"]) for i in incidents] == [("crash", "node0")], incidents
    actions = client.get("/api/v1/runs/r1/actions", headers=OPERATOR).json()["actions"]
    assert [a["cause"] for a in actions] == ["crash"]
    assert actions[0]["plan"]["membership"]["members"] == {"node0": 0, "node1": 1}


def test_the_survivor_of_the_rendezvous_store_hosts_death_is_that_hosts_death() -> None:
    """The node hosting the attempt's c10d store dies: the survivor's worker fails on gloo,
    then its torchrun loses the store (``RendezvousConnectionError``) before it writes any
    failure summary, so the agent reports torchrun's own error (captured: two torchruns of
    train_ddp.py on CPU, the store host's tree SIGKILLed mid-run).  With the host silent,
    that is the host's death (one node-lost restart), never a crash of the survivor."""
    from pathlib import Path

    from trainwarden.agent.launcher import (
        attach_root_causes,
        launcher_failure,
        parse_failure_summary,
    )

    out = (Path(__file__).parents[2] / "data" / "tracebacks" /
           "c10d_store_host_lost.stderr.txt").read_text()
    failed = parse_failure_summary(out)
    attach_root_causes(failed, out, out)
    assert failed == []  # torchrun died on the store before its summary
    entry = launcher_failure(1, out)
    assert entry is not None and "RendezvousConnectionError" in entry["message"]
    ex = policy.ExitFacts(id=1, agent_id=1, node="node0", attempt=0, outcome="crashed",
                          exit_code=1, signal=None, failed_ranks=[entry])
    d = policy.on_exit(RUN, ex, agent_ids=frozenset({1, 2}), completed_agent_ids=frozenset(),
                       checkpoint="/ck/step_20", cfg=CFG, now=1000.0,
                       silent_peers={"node1": 5.4}, may_wait=True)
    assert isinstance(d, policy.Restart), d
    assert d.cause == RestartCause.NODE_LOST and d.lost == frozenset({"node1"}), d
    assert d.incident is not None and d.incident.kind == IncidentKind.NODE_LOST

"""Each attempt's members: the pure decision (``control.membership``), and the evaluator
replacing a lost member with a spare, standing by when none is left, and restarting as soon
as a node can take the missing rank."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    OPERATOR,
    FakeClock,
    as_agent,
    crash,
    ingest,
    register,
    step,
)
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.control.membership import (
    MembershipFacts,
    Replacement,
    plan_members,
)

LIVE = frozenset({"n0", "n1", "s0", "s1"})


def facts(**kw: Any) -> MembershipFacts:
    base: dict[str, Any] = {"nnodes": 2, "epoch": 3, "members": {0: "n0", 1: "n1"},
                            "live": LIVE, "spares": ["s0", "s1"]}
    base.update(kw)
    return MembershipFacts(**base)


def test_members_fit_to_run_keep_their_ranks_and_the_epoch() -> None:
    p = plan_members(facts())
    assert p.members == {0: "n0", 1: "n1"} and p.epoch == 3
    assert p.replaced == () and p.waiting == () and p.summary() == ""


def test_a_lost_member_gives_its_rank_to_the_first_free_spare() -> None:
    p = plan_members(facts(live=LIVE - {"n0"}))
    assert p.members == {0: "s0", 1: "n1"} and p.epoch == 4
    assert p.replaced == (Replacement(node_rank=0, old="n0", new="s0", why="lost"),)
    assert p.summary() == "s0 takes node rank 0 of n0 (lost)"
    wire = p.wire("h:29404")
    assert wire == {"epoch": 4, "nnodes": 2, "declared": 2, "endpoint": "h:29404",
                    "members": {"s0": 0, "n1": 1}, "waiting": []}


def test_a_cordoned_member_is_replaced_and_a_silent_or_cordoned_spare_is_never_chosen() -> None:
    p = plan_members(facts(cordoned=frozenset({"n1", "s0"})))
    assert p.members == {0: "n0", 1: "s1"}
    assert p.replaced == (Replacement(node_rank=1, old="n1", new="s1", why="cordoned"),)
    p = plan_members(facts(live=LIVE - {"n1", "s0"}))
    assert p.members == {0: "n0", 1: "s1"}


def test_without_a_spare_the_rank_waits_and_keeps_its_node() -> None:
    p = plan_members(facts(live=LIVE - {"n1"}, spares=[]))
    assert p.members == {0: "n0", 1: "n1"} and p.epoch == 3
    assert p.waiting == (1,) and p.missing == {1: "n1 lost"}
    assert "node rank 1 waits for a node (n1 lost; no spare left)" in p.summary()
    # one spare, two lost members: one replaced, one waits
    p = plan_members(facts(live=frozenset({"s0"}), spares=["s0"]))
    assert p.members == {0: "s0", 1: "n1"} and p.waiting == (1,)


def test_without_a_spare_a_cordoned_member_keeps_its_rank() -> None:
    """Running on a suspect node costs less than not running: it is replaced once a spare
    is free, never stood by for."""
    p = plan_members(facts(cordoned=frozenset({"n1"}), spares=[]))
    assert p.members == {0: "n0", 1: "n1"} and p.waiting == () and p.epoch == 3
    assert p.kept_cordoned == {1: "n1"}
    assert p.summary() == "node rank 1 stays on n1 (cordoned; no spare left)"
    # cordoned and lost: it cannot run, its rank waits
    p = plan_members(facts(cordoned=frozenset({"n1"}), spares=[], live=LIVE - {"n1"}))
    assert p.waiting == (1,) and p.kept_cordoned == {}


def test_moving_the_endpoint_grows_the_epoch_and_keeps_the_members() -> None:
    """The last attempt's rendezvous port was taken: the same members, a new epoch (the port
    moves with it); a replacement already moves it, once; a one-node world has none."""
    p = plan_members(facts(), move_endpoint=True)
    assert p.members == {0: "n0", 1: "n1"} and p.epoch == 4 and p.moved
    assert p.summary() == ("the rendezvous moves to a new port (membership epoch 4): the last "
                           "one was taken")
    p = plan_members(facts(live=LIVE - {"n0"}), move_endpoint=True)
    assert p.epoch == 4 and not p.moved and p.replaced
    p = plan_members(facts(nnodes=1, members={0: "n0"}), move_endpoint=True)
    assert p.epoch == 3 and not p.moved


def test_a_command_without_a_world_decides_nothing() -> None:
    p = plan_members(facts(nnodes=None, live=frozenset()))
    assert p.members == {0: "n0", 1: "n1"} and p.nnodes is None and p.waiting == ()


# -- through the evaluator and the store ----------------------------------------------------


def get(client: TestClient, path: str) -> Any:
    r = client.get(f"/api/v1/runs/r1{path}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def start(client: TestClient, spare: bool) -> dict[str, int]:
    ids = {n: register(client, node=n)["agent_id"] for n in ("n0", "n1")}
    if spare:
        r = register(client, node="s0", spare=True)
        assert r["membership"]["role"] == "spare", r
        ids["s0"] = r["agent_id"]
    ingest(client, ids["n0"], 0, [step(0, 0), {"type": "checkpoint", "step": 1, "path": "/ck/1",
                                                 "bytes": 5, "t": 10.0, "lineage": "a0"}])
    ingest(client, ids["n1"], 0, [step(1, 0)])
    return ids


def heartbeat(client: TestClient, aid: int, seq: int, attempt: int = 0) -> dict[str, Any]:
    return ingest(client, aid, seq, [], attempt=attempt)


def test_a_lost_member_is_replaced_by_the_spare_at_once(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    ids = start(client, spare=True)
    evaluator.tick()
    clock.advance(40)  # past the node-lost deadline (30 s): n1 silent, n0 and s0 heard
    heartbeat(client, ids["n0"], 1)
    heartbeat(client, ids["s0"], 0)
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["kind"] == "node_lost" and inc["node"] == "n1"
    (act,) = get(client, "/actions")["actions"]
    assert act["kind"] == "restart" and act["cause"] == "node_lost"
    assert "s0 takes node rank 1 of n1 (lost)" in act["reason"]
    m = act["plan"]["membership"]
    assert m["members"] == {"n0": 0, "s0": 1} and m["epoch"] == 1 and m["waiting"] == []
    assert m["endpoint"] == "testclient:29501"  # n0 hosts; the port moved with the epoch
    # the restart goes to the new members; the spare learns its rank from the command
    cmd = heartbeat(client, ids["s0"], 1)["commands"]
    assert [c["plan"]["membership"]["members"]["s0"] for c in cmd] == [1]
    assert [c["kind"] for c in heartbeat(client, ids["n0"], 2)["commands"]] == ["restart"]
    # the lost node, should it wake, is told it is no longer a member
    reply = heartbeat(client, ids["n1"], 1)
    assert reply["role"] == "spare" and reply["epoch"] == 1 and reply["commands"] == []
    events = [e["name"] for e in get(client, "/events")["events"]]
    assert "membership_changed" in events


def test_without_a_spare_the_members_stand_by_and_a_spare_that_registers_ends_the_wait(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    ids = start(client, spare=False)
    evaluator.tick()
    clock.advance(40)
    heartbeat(client, ids["n0"], 1)
    evaluator.tick()
    (act,) = get(client, "/actions")["actions"]
    assert act["plan"]["membership"]["waiting"] == [1], act
    assert "node rank 1 waits for a node (n1 lost; no spare configured)" in act["reason"]
    run = get(client, "")
    assert run["condition"]["state"] == "waiting"
    assert run["condition"]["summary"].startswith("WAITING for a node (node rank 1: n1 lost); "
                                                  "no spare configured: start `trainwarden "
                                                  "agent --spare`"), run["condition"]
    assert [c["kind"] for c in heartbeat(client, ids["n0"], 2)["commands"]] == ["restart"]
    # the lost node stays silent: no restart loop, however many ticks
    for i in range(5):
        clock.advance(40)
        heartbeat(client, ids["n0"], 3 + i, attempt=1)
        evaluator.tick()
    assert len(get(client, "/actions")["actions"]) == 1
    assert get(client, "")["status"] == "restarting"
    assert [i["kind"] for i in get(client, "/incidents")["incidents"]] == ["node_lost"]
    # a spare registers: the gang restarts on it at once, counted against no budget
    register(client, node="s0", spare=True)
    evaluator.tick()
    acts = get(client, "/actions")["actions"]
    assert len(acts) == 2, acts
    new = max(acts, key=lambda a: a["id"])
    assert new["cause"] == "replace" and new["plan"]["membership"]["members"] == {
        "n0": 0, "s0": 1}
    assert new["plan"]["membership"]["waiting"] == []
    run = get(client, "")
    assert run["attempt"] == 2 and run["restarts_by_cause"]["node_lost"] == 1


def test_the_lost_node_coming_back_ends_the_wait_in_its_own_rank(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    ids = start(client, spare=False)
    evaluator.tick()
    clock.advance(40)
    heartbeat(client, ids["n0"], 1)
    evaluator.tick()
    heartbeat(client, ids["n1"], 1)  # n1 is heard again
    evaluator.tick()
    new = max(get(client, "/actions")["actions"], key=lambda a: a["id"])
    assert new["cause"] == "replace"
    assert new["plan"]["membership"]["members"] == {"n0": 0, "n1": 1}


def test_a_crash_while_a_spare_waits_restarts_on_the_same_members(
        client: TestClient, evaluator: Evaluator) -> None:
    ids = start(client, spare=True)
    ingest(client, ids["n0"], 1, [crash()])
    evaluator.tick()
    (act,) = get(client, "/actions")["actions"]
    assert act["plan"]["membership"]["members"] == {"n0": 0, "n1": 1}
    assert act["plan"]["membership"]["epoch"] == 0
    assert heartbeat(client, ids["s0"], 0)["commands"] == []  # the spare is not restarted
    assert as_agent(client, ids["s0"])  # (it keeps its credential)


def port_taken(attempt: int = 0) -> dict[str, Any]:
    """What the agent on the rendezvous host reports when its torchrun could not listen."""
    msg = ("The server socket has failed to listen on any local network address. port: "
           "29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    return {"type": "exit", "attempt": attempt, "t": 200.0, "exit_code": 1, "signal": None,
            "outcome": "crashed",
            "failed_ranks": [{"rank": None, "exit_code": 1, "launcher": True,
                              "message": f"torch.distributed.DistNetworkError: {msg}",
                              "root_cause": {
                                  "exc_type": "torch.distributed.DistNetworkError",
                                  "message": msg, "source": "launcher", "traceback": "",
                                  "frame": {"file": "/x/torch/distributed/elastic/rendezvous/"
                                                    "static_tcp_rendezvous.py",
                                            "line": 67, "function": "next_rendezvous"},
                                  "user_frame": None, "rank": None, "host": "n0"}}]}


def test_a_taken_rendezvous_port_moves_the_endpoint_and_is_no_evidence_against_the_node(
        client: TestClient, evaluator: Evaluator) -> None:
    """The rendezvous host's torchrun could not listen (its port taken): the incident names
    torchrun's error, the restart keeps the members on a new port, and the node is not
    charged with an infrastructure failure (twice would cordon it)."""
    ids = start(client, spare=False)
    for attempt in (0, 1):
        ingest(client, ids["n0"], 1 + attempt, [port_taken(attempt)], attempt=attempt)
        evaluator.tick()
        inc = max(get(client, "/incidents")["incidents"], key=lambda i: i["id"])
        assert inc["cause"].startswith("torch.distributed.DistNetworkError: The server socket "
                                       "has failed to listen"), inc
        assert "torchrun on node n0 exited with code 1" in inc["cause"]
        act = max(get(client, "/actions")["actions"], key=lambda a: a["id"])
        m = act["plan"]["membership"]
        assert m["members"] == {"n0": 0, "n1": 1} and m["epoch"] == 1 + attempt
        assert m["endpoint"] == f"testclient:{29501 + attempt}"
        assert "the rendezvous moves to a new port" in act["reason"]
        heartbeat(client, ids["n1"], 1 + attempt, attempt=attempt)
        for aid in ids.values():  # each agent takes the restart (the attempt moves on)
            heartbeat(client, aid, 10 + attempt, attempt=attempt + 1)
    host = client.get("/api/v1/hosts/n0", headers=OPERATOR).json()
    assert host["state"] == "healthy" and host["evidence"] == [], host


def test_a_member_that_never_takes_the_restart_is_lost_and_replaced(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    """The survivor of a dead node reports the crash first: the gang restart waits on the dead
    node, whose agent never takes it; once it is silent past the deadline its rank goes to the
    spare (the restart is not left waiting for ever)."""
    ids = start(client, spare=True)
    clock.advance(1)
    ingest(client, ids["n0"], 1, [crash()])
    evaluator.tick()
    assert get(client, "")["status"] == "restarting"
    clock.advance(40)
    heartbeat(client, ids["n0"], 2)
    heartbeat(client, ids["s0"], 0)
    evaluator.tick()
    acts = sorted(get(client, "/actions")["actions"], key=lambda a: a["id"])
    assert [a["cause"] for a in acts] == ["crash", "node_lost"], acts
    assert acts[0]["status"] == "superseded"
    assert acts[1]["plan"]["membership"]["members"] == {"n0": 0, "s0": 1}
    lost = [i for i in get(client, "/incidents")["incidents"] if i["kind"] == "node_lost"]
    assert [i["node"] for i in lost] == ["n1"]


def cordon(client: TestClient, node: str) -> None:
    r = client.post(f"/api/v1/hosts/{node}/cordon", headers=OPERATOR,
                    json={"reason": "bad fans"})
    assert r.status_code == 200, r.text


def test_a_cordoned_member_is_replaced_at_the_next_restart(
        client: TestClient, evaluator: Evaluator) -> None:
    ids = start(client, spare=True)
    cordon(client, "n1")
    evaluator.tick()
    assert get(client, "/actions")["actions"] == []  # a cordon restarts nothing by itself
    ingest(client, ids["n0"], 1, [crash()])
    evaluator.tick()
    (act,) = get(client, "/actions")["actions"]
    assert act["plan"]["membership"]["members"] == {"n0": 0, "s0": 1}
    assert "s0 takes node rank 1 of n1 (cordoned)" in act["reason"]


def test_a_member_cordoned_while_its_restart_is_pending_is_replaced_before_it_trains(
        client: TestClient, evaluator: Evaluator) -> None:
    ids = start(client, spare=True)
    ingest(client, ids["n0"], 1, [crash()])
    evaluator.tick()
    cordon(client, "n1")
    evaluator.tick()
    acts = sorted(get(client, "/actions")["actions"], key=lambda a: a["id"])
    assert [(a["cause"], a["status"]) for a in acts] == [("crash", "superseded"),
                                                         ("replace", "queued")], acts
    assert acts[1]["plan"]["membership"]["members"] == {"n0": 0, "s0": 1}
    assert acts[1]["plan"]["checkpoint"] == acts[0]["plan"]["checkpoint"] == "/ck/1"
    evaluator.tick()
    assert len(get(client, "/actions")["actions"]) == 2  # decided once


PEER_RESET = {"exc_type": "RuntimeError",
              "message": "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: "
                         "Connection reset by peer",
              "frame": {"file": "/x/train.py", "line": 84, "function": "main"},
              "user_frame": {"file": "/x/train.py", "line": 84, "function": "main"},
              "traceback": "Traceback (most recent call last):\n  File \"/x/train.py\", line 84,"
                           " in main\nRuntimeError: Connection reset by peer",
              "source": "stderr", "rank": 0, "host": "h0"}


def test_the_crash_incident_names_the_dead_nodes_rank_not_the_survivor_that_lost_it(
        client: TestClient, evaluator: Evaluator, clock: FakeClock) -> None:
    """The survivor's exit (its rank lost its peer) arrives first and is held (no peer is
    silent: it may be a symptom); the killed rank's exit, arriving while it is held, opens
    the incident naming the killed rank, and the survivor's is an echo of it."""
    ids = start(client, spare=True)
    survivor = {"type": "exit", "attempt": 0, "t": 200.0, "exit_code": 1, "signal": None,
                "outcome": "crashed",
                "failed_ranks": [{"rank": 0, "local_rank": 0, "exit_code": 1, "signal": None,
                                  "pid": 11, "message": "exited with code 1",
                                  "root_cause": PEER_RESET}]}
    killed = {"type": "exit", "attempt": 0, "t": 200.1, "exit_code": None, "signal": None,
              "outcome": "crashed",
              "failed_ranks": [{"rank": 1, "local_rank": 0, "exit_code": -9, "signal": 9,
                                "pid": 12, "message": "Signal 9 (SIGKILL) received"}]}
    ingest(client, ids["n0"], 1, [survivor])
    evaluator.tick()
    assert get(client, "/incidents")["incidents"] == []  # held: a symptom, maybe
    ingest(client, ids["n1"], 1, [killed])
    clock.advance(1)
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    assert (inc["node"], inc["rank"], inc["signal"]) == ("n1", 1, 9), inc
    assert len(get(client, "/actions")["actions"]) == 1  # decided once
    clock.advance(1)
    evaluator.tick()  # the survivor's held exit: an echo of the same failure
    assert len(get(client, "/incidents")["incidents"]) == 1
    assert len(get(client, "/actions")["actions"]) == 1
    host = client.get("/api/v1/hosts/n1", headers=OPERATOR).json()
    assert [e["kind"] for e in host["evidence"]] == ["infra_failure"], host
    assert client.get("/api/v1/hosts/n0", headers=OPERATOR).json()["evidence"] == []


def _completed(client: TestClient, ids: dict[str, int]) -> None:
    for i, node in enumerate(("n0", "n1")):
        ingest(client, ids[node], 5, [{"type": "exit", "t": 100.0, "attempt": 0,
                                       "exit_code": 0, "outcome": "completed",
                                       "failed_ranks": [], "rank": i}])


@pytest.mark.parametrize("end", ["completed", "stopped"])
def test_an_ended_run_reports_no_missing_rank_and_no_node_metric(
        client: TestClient, evaluator: Evaluator, clock: FakeClock, end: str) -> None:
    """Past the node-lost deadline after the end, every node of the run is silent (it left):
    no rank waits for a node, and ``trainwarden_run_nodes_missing`` reads 0.  What a user
    saw instead: ``membership.missing`` turned from [] to [1] 30 s after a clean
    completion, the metric read 1, and ``trainwarden nodes`` said a rank waits."""
    ids = start(client, spare=True)
    evaluator.tick()
    if end == "completed":
        _completed(client, ids)
    else:
        r = client.post("/api/v1/runs/r1/stop", headers=OPERATOR, json={"reason": "enough"})
        assert r.status_code == 200, r.text
    evaluator.tick()
    assert get(client, "")["status"] == end
    clock.advance(40)
    heartbeat(client, ids["s0"], 1)  # the spare is heard a while longer than the members
    evaluator.tick()
    run = get(client, "")
    assert run["membership"]["missing"] == [], run["membership"]
    metrics = client.get("/metrics", headers=OPERATOR).text
    assert 'trainwarden_run_nodes_missing{run="r1"} 0.0' in metrics


def _nodes(client: TestClient) -> dict[str, dict[str, Any]]:
    return {a["node"]: a for a in get(client, "")["agents"]}


def _cli_nodes(client: TestClient, capsys: pytest.CaptureFixture[str]) -> dict[str, list[str]]:
    """``trainwarden nodes r1`` against the app: node -> its row's cells."""
    from trainwarden.supervisor.cli import client as cli

    capsys.readouterr()
    with TestClient(client.app, base_url="http://testserver/api/v1", headers=OPERATOR) as c:
        assert cli._nodes(c, argparse.Namespace(run="r1")) == 0
    out = capsys.readouterr().out.splitlines()
    return {line.split()[0]: line.split() for line in out[2:] if line.startswith(("n", "s"))}


def _working(client: TestClient, aid: int, seq: int, attempt: int = 0) -> None:
    now = client.app.state.clock()  # type: ignore[attr-defined]
    ingest(client, aid, seq, [{"type": "heartbeat", "t": now, "attempt": attempt,
                               "state": "running",
                               "workers": [{"rank": 0, "pid": 7, "cpu_percent": 98.0,
                                            "rss_bytes": 2 ** 30}]}], attempt=attempt)


def test_a_silent_node_reads_lost_with_stale_readings_and_the_survivor_reads_waiting(
        client: TestClient, evaluator: Evaluator, clock: FakeClock,
        capsys: pytest.CaptureFixture[str]) -> None:
    """What a user saw instead: the SIGKILLed node read ``running``, with its last worker CPU
    and memory, 45 s later; the surviving member standing by read ``spare``."""
    ids = start(client, spare=False)
    _working(client, ids["n0"], 1)
    _working(client, ids["n1"], 1)
    evaluator.tick()
    assert {n: a["state"] for n, a in _nodes(client).items()} == {"n0": "running",
                                                                "n1": "running"}
    clock.advance(45)  # n1 was SIGKILLed: silent since; n0's workers lost their peer
    ingest(client, ids["n0"], 2, [{"type": "heartbeat", "t": clock.now, "state": "failed"}])
    evaluator.tick()
    (act,) = get(client, "/actions")["actions"]
    assert act["plan"]["membership"]["waiting"] == [1]
    assert _nodes(client)["n0"]["state"] == "waiting"  # (its workers failed: it waits)
    ingest(client, ids["n0"], 3, [{"type": "heartbeat", "t": clock.now, "attempt": 1,
                                   "state": "spare"}], attempt=1)  # the agent stood by
    nodes = _nodes(client)
    assert nodes["n1"]["state"] == "lost", nodes["n1"]
    assert nodes["n1"]["readings_stale"] is True and nodes["n1"]["seen_s"] >= 45
    assert nodes["n1"]["workers"][0]["cpu_percent"] == 98.0  # kept, as last seen
    assert nodes["n0"]["state"] == "waiting" and nodes["n0"]["role"] == "member"
    assert nodes["n0"]["reported_state"] == "spare" and not nodes["n0"]["readings_stale"]
    rows = _cli_nodes(client, capsys)  # the CLI shows the same states
    assert rows["n1"][3] == "lost" and rows["n0"][3] == "waiting", rows
    # A spare registers and takes n1's rank: n1 reads replaced (never spare), s0 a member.
    register(client, node="s0", spare=True)
    evaluator.tick()
    nodes = _nodes(client)
    assert nodes["n1"]["state"] == "replaced" and nodes["n1"]["role"] == "spare"
    assert nodes["s0"]["role"] == "member"
    assert _cli_nodes(client, capsys)["n1"][3] == "replaced"

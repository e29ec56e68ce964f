"""Crash policy: pure decisions, and the evaluator driving them through the store and API."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import (
    OPERATOR,
    FakeClock,
    command_rows,
    crash,
    ingest,
    register,
    step,
)
from trainwarden.agent.core.findings import Severity
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.store.db import Database

CFG = policy.PolicyConfig(restart_budget=2, backoff_s=1.0, backoff_max_s=3.0)
RUN = policy.RunFacts(id=1, name="r", status="running", attempt=2, restarts=0)


def exit_(attempt: int, outcome: str = "crashed", agent: int = 1, code: int | None = 1
          ) -> policy.ExitFacts:
    return policy.ExitFacts(id=1, agent_id=agent, node=f"n{agent}", attempt=attempt,
                            outcome=outcome, exit_code=code, signal=None,
                            failed_ranks=[{"rank": 3, "exit_code": None, "signal": 9}])


def decide(run: policy.RunFacts, ex: policy.ExitFacts, completed: frozenset[int] = frozenset()
           ) -> policy.Decision:
    return policy.on_exit(run, ex, agent_ids=frozenset({1, 2}), completed_agent_ids=completed,
                          checkpoint="/ck/9", cfg=CFG, now=100.0)


def test_policy_crash_restarts_from_newest_checkpoint() -> None:
    d = decide(RUN, exit_(2))
    assert isinstance(d, policy.Restart)
    assert d.attempt == 3 and d.checkpoint == "/ck/9" and d.not_before == 101.0
    assert d.incident is not None and d.incident.rank == 3 and d.incident.signal == 9
    assert "signal 9" in d.incident.cause
    plan = d.plan(action_id=5)
    assert plan["checkpoint"] == "/ck/9" and plan["attempt"] == 3 and plan["action_id"] == 5
    from trainwarden.agent.protocol import ResumePlan

    assert ResumePlan.from_dict(plan).attempt == 3  # the agent side can read it


def test_policy_backoff_and_budget() -> None:
    assert [policy.backoff_s(n, CFG) for n in range(4)] == [1.0, 2.0, 3.0, 3.0]
    d = decide(policy.RunFacts(1, "r", "running", 2, restarts=2), exit_(2))
    assert isinstance(d, policy.Stop) and d.status == "failed" and "budget" in d.reason


def test_policy_late_and_final_exits_are_notes() -> None:
    assert decide(RUN, exit_(1)) == policy.Note("late", "exit of attempt 1; the run is at 2")
    assert isinstance(decide(RUN, exit_(3)), policy.Note)
    done = policy.RunFacts(1, "r", "failed", 2, 0)
    assert isinstance(decide(done, exit_(2)), policy.Note)


def test_policy_completion_needs_every_agent() -> None:
    assert decide(RUN, exit_(2, "completed", agent=1, code=0)) == policy.Note(
        "completed", "waiting for the other agents to complete")
    assert isinstance(decide(RUN, exit_(2, "completed", 2, 0), frozenset({1})), policy.Complete)
    # "completed" with a non-zero code is a failure
    assert isinstance(decide(RUN, exit_(2, "completed", 2, 3)), policy.Restart)


# --- through the store and the API -----------------------------------------------------------


def two_nodes(client: TestClient) -> tuple[int, int]:
    a0 = register(client, node="n0")["agent_id"]
    a1 = register(client, node="n1")["agent_id"]
    ingest(client, a0, 0, [step(0, 0), step(1, 0)])
    ingest(client, a1, 0, [step(2, 0), step(3, 0)])
    ingest(client, a0, 1, [{"type": "checkpoint", "step": 1, "path": "/ck/1", "bytes": 5,
                            "t": 10.0, "lineage": "a0"}])
    return a0, a1


def get(client: TestClient, path: str) -> Any:
    r = client.get(f"/api/v1/runs/r1{path}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def test_the_survivor_of_a_peers_death_is_not_blamed_for_it(
    client: TestClient, evaluator: Evaluator
) -> None:
    """Rank 1 is SIGKILLed; rank 0 fails on the reset connection (and says so) and aborts,
    and torchrun lists rank 0 as the root cause: the incident names rank 1."""
    a0, _ = two_nodes(client)
    exit_item = crash(attempt=0, rank=0)
    exit_item["failed_ranks"] = [
        {"rank": 0, "local_rank": 0, "exit_code": -6, "signal": 6, "pid": 10,
         "message": "Signal 6 (SIGABRT) received by PID 10"},
        {"rank": 1, "local_rank": 1, "exit_code": -9, "signal": 9, "pid": 11,
         "message": "Signal 9 (SIGKILL) received by PID 11"}]
    ingest(client, a0, 2, [{"type": "event", "rank": 0, "attempt": 0, "t": 199.0,
                            "name": "distributed_error",
                            "message": "RuntimeError: Connection reset by peer"}, exit_item])
    evaluator.tick()
    (inc,) = get(client, "/incidents")["incidents"]
    assert inc["rank"] == 1 and inc["signal"] == 9 and "SIGKILL" in inc["cause"], inc


def test_crash_opens_one_incident_and_restarts_every_agent(
    client: TestClient, evaluator: Evaluator, db: Database, clock: FakeClock
) -> None:
    a0, a1 = two_nodes(client)
    ingest(client, a0, 2, [crash(attempt=0, rank=1, code=7)])
    evaluator.tick()
    # The peer node's workers die too and report it, for the same (now old) attempt.
    r1 = ingest(client, a1, 1, [crash(attempt=0, rank=2, code=1)])
    evaluator.tick()
    evaluator.tick()
    incidents = get(client, "/incidents")["incidents"]
    assert len(incidents) == 1
    inc = incidents[0]
    assert inc["kind"] == "crash" and inc["node"] == "n0" and inc["rank"] == 1
    assert inc["exit_code"] == 7 and inc["attempt"] == 0 and "code 7" in inc["cause"]
    assert inc["step"] == 1  # rank 1 reported step 0: it failed in step 1
    run = get(client, "")
    assert run["status"] == "restarting" and run["attempt"] == 1 and run["restarts"] == 1
    # one restart command per agent, carried by the ingest reply
    assert [c["kind"] for c in r1["commands"]] == ["restart"]
    cmd1 = r1["commands"][0]
    assert cmd1["attempt"] == 1 and cmd1["plan"]["checkpoint"] == "/ck/1"
    assert cmd1["plan"]["attempt"] == 1 and cmd1["not_before"] == clock.now + 1.0
    r0 = ingest(client, a0, 3, [])
    assert [c["kind"] for c in r0["commands"]] == ["restart"] and r0["attempt"] == 1
    with db.read() as c:
        cmds = command_rows(c, run_id=1)
    assert sorted(x["agent_id"] for x in cmds) == [a0, a1]
    acts = get(client, "/actions")["actions"]
    assert len(acts) == 1 and acts[0]["actor"] == "policy" and acts[0]["status"] == "queued"
    assert acts[0]["incident_id"] == inc["id"] and acts[0]["plan"]["action_id"] == acts[0]["id"]


def test_commands_resent_until_acknowledged_and_action_progress(
    client: TestClient, evaluator: Evaluator, clock: FakeClock
) -> None:
    a0, a1 = two_nodes(client)
    ingest(client, a0, 2, [crash()])
    evaluator.tick()
    c0 = ingest(client, a0, 3, [])["commands"][0]
    assert ingest(client, a0, 4, [])["commands"][0]["id"] == c0["id"]  # re-sent
    c1 = ingest(client, a1, 1, [])["commands"][0]
    ack = {"type": "command_result", "t": 1.0, "status": "delivered", "detail": ""}
    assert ingest(client, a0, 5, [{**ack, "command_id": c0["id"]}])["commands"] == []
    evaluator.tick()
    assert get(client, "/actions")["actions"][0]["status"] == "queued"  # a1 has not acked
    ingest(client, a1, 2, [{**ack, "command_id": c1["id"]}])
    evaluator.tick()
    assert get(client, "/actions")["actions"][0]["status"] == "delivered"
    done = {**ack, "status": "done"}
    ingest(client, a0, 6, [{**done, "command_id": c0["id"]}])
    ingest(client, a1, 3, [{**done, "command_id": c1["id"]}])
    evaluator.tick()
    assert get(client, "/actions")["actions"][0]["status"] == "restarted"
    # the new attempt reports its first step (resumed from the checkpoint: step 1)
    ingest(client, a0, 7, [step(0, 1, attempt=1), step(1, 1, attempt=1)], attempt=1)
    clock.advance(5)
    evaluator.tick()
    act = get(client, "/actions")["actions"][0]
    assert act["status"] == "resumed" and act["resumed_step"] == 1
    assert set(act["progress"]) == {"queued", "delivered", "restarted", "resumed"}
    run = get(client, "")
    assert run["status"] == "running" and run["attempt"] == 1 and run["step"] == 1
    assert get(client, "/incidents")["incidents"][0]["status"] == "resolved"


def test_old_attempt_messages_are_ignored(client: TestClient, evaluator: Evaluator) -> None:
    a0, a1 = two_nodes(client)
    ingest(client, a0, 2, [crash()])
    evaluator.tick()
    # Late reports of attempt 0 (a step and another crash) after the restart was decided.
    ingest(client, a1, 1, [step(2, 1, attempt=0), crash(attempt=0)])
    ingest(client, a0, 3, [crash(attempt=0, rank=0)])
    evaluator.tick()
    assert len(get(client, "/incidents")["incidents"]) == 1
    assert len(get(client, "/actions")["actions"]) == 1
    run = get(client, "")
    assert run["attempt"] == 1 and run["restarts"] == 1 and run["status"] == "restarting"
    # An old-attempt step does not count as the resume.
    assert get(client, "/actions")["actions"][0]["status"] == "queued"


def test_budget_exhaustion_fails_the_run_and_stops_agents(
    client: TestClient, evaluator: Evaluator, clock: FakeClock
) -> None:
    a0, a1 = two_nodes(client)  # budget 3 in the fixture settings
    seq = {a0: 2, a1: 1}
    expected_backoff = [1.0, 2.0, 4.0]
    for attempt in range(3):
        ingest(client, a0, seq[a0], [crash(attempt=attempt)])
        seq[a0] += 1
        evaluator.tick()
        cmd = ingest(client, a1, seq[a1], [])["commands"][0]
        seq[a1] += 1
        assert cmd["kind"] == "restart" and cmd["attempt"] == attempt + 1
        assert cmd["not_before"] == clock.now + expected_backoff[attempt]
        clock.advance(10)
    ingest(client, a0, seq[a0], [crash(attempt=3)])
    seq[a0] += 1
    evaluator.tick()
    run = get(client, "")
    assert run["status"] == "failed" and "budget" in run["reason"] and run["restarts"] == 3
    assert len(get(client, "/incidents")["incidents"]) == 4
    for aid in (a0, a1):
        cmds = ingest(client, aid, seq[aid], [])["commands"]
        assert [c["kind"] for c in cmds] == ["stop"]  # the unacked restart was superseded
    acts = get(client, "/actions")["actions"]
    assert acts[0]["kind"] == "stop" and acts[0]["actor"] == "policy"
    # Exits after the run failed change nothing.
    ingest(client, a1, seq[a1] + 1, [crash(attempt=3)])
    evaluator.tick()
    assert len(get(client, "/incidents")["incidents"]) == 4


def test_run_completes_when_every_agent_completes(
    client: TestClient, evaluator: Evaluator
) -> None:
    a0, a1 = two_nodes(client)
    ok = {"type": "exit", "attempt": 0, "exit_code": 0, "outcome": "completed",
          "failed_ranks": []}
    ingest(client, a0, 2, [ok])
    evaluator.tick()
    assert get(client, "")["status"] == "running"
    ingest(client, a1, 1, [ok])
    evaluator.tick()
    assert get(client, "")["status"] == "completed"
    assert get(client, "/incidents")["incidents"] == []


def test_operator_restart_and_stop(client: TestClient, evaluator: Evaluator) -> None:
    a0, _a1 = two_nodes(client)
    r = client.post("/api/v1/runs/r1/restart", headers=OPERATOR,
                    json={"step": 1, "reason": "try again"})
    assert r.status_code == 200, r.text
    cmd = ingest(client, a0, 2, [])["commands"][0]
    assert cmd["plan"]["checkpoint"] == "/ck/1" and cmd["attempt"] == 1
    act = get(client, "/actions")["actions"][0]
    assert act["actor"] == "operator" and act["reason"] == "try again"
    # It restarted the workers (a restart, shown as one), outside every budget.
    run = get(client, "")
    assert run["restarts"] == 1
    assert run["restarts_by_cause"] == {"crash": 0, "hang": 0, "node_lost": 0, "spike": 0,
                                        "sdc": 0, "operator": 1, "replace": 0,
                                        "grow": 0, "partition": 0}
    assert client.post("/api/v1/runs/r1/stop", headers=OPERATOR, json={}).status_code == 200
    assert get(client, "")["status"] == "stopped"
    r = client.post("/api/v1/runs/r1/stop", headers=OPERATOR, json={})
    assert r.status_code == 409 and "stopped" in r.json()["detail"]


def test_simultaneous_crash_reports_of_both_nodes_open_one_incident(
    client: TestClient, evaluator: Evaluator
) -> None:
    a0, a1 = two_nodes(client)
    ingest(client, a1, 1, [crash(attempt=0, rank=2)])
    ingest(client, a0, 2, [crash(attempt=0, rank=1)])
    rep = evaluator.tick()
    assert rep.exits == 2 and rep.decisions == 1
    assert len(get(client, "/incidents")["incidents"]) == 1
    assert get(client, "")["attempt"] == 1


def test_completion_of_the_previous_attempt_before_the_restart_reached_it() -> None:
    run = policy.RunFacts(id=1, name="r", status="restarting", attempt=3, restarts=1)
    done = exit_(2, "completed", agent=1, code=0)
    d = policy.on_exit(run, done, agent_ids=frozenset({1}), completed_agent_ids=frozenset(),
                       checkpoint=None, cfg=CFG, now=1.0, restart_pending=True)
    assert isinstance(d, policy.Complete) and "before the restart" in d.reason
    # Once the workers were relaunched, the old attempt's exit is only late.
    d = policy.on_exit(run, done, agent_ids=frozenset({1}), completed_agent_ids=frozenset(),
                       checkpoint=None, cfg=CFG, now=1.0, restart_pending=False)
    assert isinstance(d, policy.Note) and d.verdict == "late"


def test_restarts_without_progress_counts_the_restarts_since_the_high_last_grew() -> None:
    f = policy.restarts_without_progress
    assert f([], 100) == 0 and f([50], None) == 0
    assert f([29, 29, 29], 29) == 3  # a crash loop below step 29
    assert f([10, 29, 29], 29) == 2  # the run passed step 10 after the first
    assert f([29, 29], 40) == 0  # the running attempt passed the old high
    assert f([None, 29], 29) == 1


def test_budgets_left_and_the_cause_a_restart_counts_under() -> None:
    cfg = policy.PolicyConfig(restart_budget=3, rollback_budget=2)
    assert policy.budgets_left({"hang": 1, "spike": 2}, cfg) == {
        "crash": 3, "hang": 2, "node_lost": 3, "spike": 0, "sdc": 3}
    assert policy.CAUSE_OF_KIND["collective_timeout"] == "hang"
    assert policy.restart_cause("policy", "hang") == "hang"
    assert policy.restart_cause("operator", "crash") == "operator"


def test_an_exit_that_arrives_while_the_detectors_run_is_not_dated_before_it(
    client: TestClient, evaluator: Evaluator, clock: FakeClock
) -> None:
    """A tick's decisions are dated no earlier than what they act on: an exit stored while
    the detectors ran (a new leader's first tick starts the observer process: a second or
    more) gets an incident and a restart dated after it, not at the tick's start."""
    a0, _a1 = two_nodes(client)
    real = evaluator.observer
    arrived: list[float] = []

    class SlowObserver:
        def observe(self, db: Database, req: Any, keepalive: Any = None) -> Any:
            out = real.observe(db, req, keepalive=keepalive)
            clock.advance(1.0)
            arrived.append(clock.now)
            ingest(client, a0, 2, [{**crash(attempt=0, rank=1, code=7), "t": clock.now}])
            return out

    evaluator.observer = SlowObserver()  # type: ignore[assignment]
    evaluator.tick()
    incidents = get(client, "/incidents")["incidents"]
    assert len(incidents) == 1
    assert incidents[0]["opened_at"] >= arrived[0]
    acts = get(client, "/actions")["actions"]
    assert len(acts) == 1 and acts[0]["created_at"] >= arrived[0]


def test_a_restart_whose_attempt_trained_and_finished_within_one_tick_is_resumed(
    client: TestClient, evaluator: Evaluator, clock: FakeClock
) -> None:
    """The new attempt's first steps and its clean exits reach the store between two ticks
    (a short remainder, a slow tick): the restart did resume, so the action says so, with
    the step it resumed at; it is not marked superseded by the run's completion."""
    a0, a1 = two_nodes(client)
    ingest(client, a0, 2, [crash()])
    evaluator.tick()
    c0 = ingest(client, a0, 3, [])["commands"][0]
    c1 = ingest(client, a1, 1, [])["commands"][0]
    done = {"type": "command_result", "t": 1.0, "status": "done", "detail": ""}
    ingest(client, a0, 4, [{**done, "command_id": c0["id"]}])
    ingest(client, a1, 2, [{**done, "command_id": c1["id"]}])
    finished = {"type": "exit", "attempt": 1, "t": 300.0, "exit_code": 0, "signal": None,
                "outcome": "completed", "failed_ranks": []}
    ingest(client, a0, 5, [step(0, 1, attempt=1), step(0, 2, attempt=1), finished], attempt=1)
    ingest(client, a1, 3, [step(1, 1, attempt=1), step(1, 2, attempt=1), finished], attempt=1)
    evaluator.tick()
    assert get(client, "")["status"] == "completed"
    act = get(client, "/actions")["actions"][0]
    assert act["status"] == "resumed" and act["resumed_step"] == 1, act


def _failed(exc: str, msg: str, file: str, **entry: Any) -> policy.ExitFacts:
    rc = {"exc_type": exc, "message": msg, "traceback": "", "source": "stderr",
          "frame": {"file": file, "line": 7, "function": "f"}, "user_frame": None}
    if "train.py" in file:
        rc["user_frame"] = rc["frame"]
    return policy.ExitFacts(id=1, agent_id=1, node="n1", attempt=2, outcome="crashed",
                            exit_code=1, signal=None,
                            failed_ranks=[{"rank": 0, "exit_code": 1, "root_cause": rc,
                                           **entry}])


def test_only_torch_distributed_failing_on_a_taken_port_moves_the_rendezvous() -> None:
    """The rendezvous store could not listen: the next attempt meets on another port.  The
    script's own code failing to take a port (its metrics server, say) is the script's
    business: the rendezvous stays."""
    taken = ("The server socket has failed to listen on any local network address. port: "
             "29500, useIpv6: false, code: -98, name: EADDRINUSE, message: address already in use")
    d = decide(RUN, _failed("torch.distributed.DistNetworkError", taken,
                            "/v/torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py",
                            rank=None, launcher=True))
    assert isinstance(d, policy.Restart) and d.move_endpoint
    assert d.incident is not None and "torchrun on node n1 exited with code 1" in d.incident.cause
    d = decide(RUN, _failed("OSError", "[Errno 98] Address already in use", "/home/u/train.py"))
    assert isinstance(d, policy.Restart) and not d.move_endpoint
    assert d.incident is not None and "worker on node n1 rank 0" in d.incident.cause
    d = decide(RUN, exit_(2))
    assert isinstance(d, policy.Restart) and not d.move_endpoint


def _sdc(**details: Any) -> policy.FindingFacts:
    d = {"corrupt": [2], "replicas": 3, "first_disagreement": 200, "last_agreed_step": 150,
         **details}
    return policy.FindingFacts(kind="silent_data_corruption", severity=Severity.INCIDENT,
                               message=policy.sdc_message(d, "node0"), attempt=RUN.attempt,
                               step=200, rank=2, node="node0", details=d)


def test_silent_data_corruption_rolls_back_to_the_newest_agreed_checkpoint() -> None:
    rec = policy.RecoveryFacts(checkpoints=((100, "/ck/step_100"), (150, "/ck/step_150"),
                                            (200, "/ck/step_200")))
    d = policy.on_finding(RUN, _sdc(), incident_kinds_this_attempt=frozenset(),
                          open_watch=frozenset(), checkpoint="/ck/step_200", cfg=CFG, now=50.0,
                          recovery=rec)
    assert isinstance(d, policy.Restart), d
    assert (d.checkpoint, d.rollback_to_step, d.cause) == ("/ck/step_150", 150, "sdc")
    assert d.skip == () and d.lr is None and d.not_before == 50.0
    assert d.incident is not None and d.incident.kind == "silent_data_corruption"
    assert (d.incident.rank, d.incident.node, d.incident.step) == (2, "node0", 200)
    assert d.incident.details["checkpoint"] == "/ck/step_150"
    assert d.incident.cause == ("silent data corruption: the replicas' parameter fingerprints "
                                "disagree at step 200: rank 2 on node node0 disagrees with the "
                                "other 2 replicas; roll back to step 150, the newest checkpoint "
                                "the replicas agreed on (/ck/step_150)")
    assert "roll back to step 150, the newest checkpoint the replicas agreed on" in d.reason
    # No agreed step known (the first check of the attempt disagreed): before the
    # first disagreement.
    d = policy.on_finding(RUN, _sdc(last_agreed_step=None, first_disagreement=150),
                          incident_kinds_this_attempt=frozenset(), open_watch=frozenset(),
                          checkpoint=None, cfg=CFG, now=50.0, recovery=rec)
    assert isinstance(d, policy.Restart) and d.checkpoint == "/ck/step_100"
    # Nothing agreed to go back to: stopped, saying why; the budget spent: stopped.
    d = policy.on_finding(RUN, _sdc(last_agreed_step=50), incident_kinds_this_attempt=frozenset(),
                          open_watch=frozenset(), checkpoint=None, cfg=CFG, now=50.0,
                          recovery=rec)
    assert isinstance(d, policy.Stop) and "no complete checkpoint at or before step 50" in d.reason
    spent = policy.RecoveryFacts(checkpoints=rec.checkpoints, restarts_by_cause={"sdc": 2})
    d = policy.on_finding(RUN, _sdc(), incident_kinds_this_attempt=frozenset(),
                          open_watch=frozenset(), checkpoint=None, cfg=CFG, now=50.0,
                          recovery=spent)
    assert isinstance(d, policy.Stop) and "restart (sdc) budget of 2 spent" in d.reason
    # The attempt already failed otherwise: an echo.
    d = policy.on_finding(RUN, _sdc(), incident_kinds_this_attempt=frozenset({"crash"}),
                          open_watch=frozenset(), checkpoint=None, cfg=CFG, now=50.0,
                          recovery=rec)
    assert isinstance(d, policy.Note) and d.verdict == "echo"
    # Two replicas: suspects, no rank.
    two = {"corrupt": [], "suspects": [0, 1], "replicas": 2, "first_disagreement": 200}
    assert policy.sdc_message(two, None) == (
        "silent data corruption: the replicas' parameter fingerprints disagree at step 200: "
        "ranks 0, 1 disagree and no majority names the corrupt one")


def test_a_member_cordoned_for_corruption_with_no_spare_stops_the_run_naming_the_checkpoint(
        ) -> None:
    """The stop's reason names the checkpoint to resume from, and what it is: the newest the
    replicas agreed on when the pending restart is the corruption's rollback, else only the
    pending restart's own (a crash's restart, the cordon from another run's evidence)."""
    from trainwarden.agent.protocol import ResumePlan

    cordoned = {"node1": "silent data corruption twice within 24 h (incidents 3, 5)"}
    plan = ResumePlan(checkpoint="/ck/step_150")
    d = policy.on_corrupting_member(RUN, cordoned=cordoned, pending=plan)
    assert isinstance(d, policy.Stop) and d.status == "failed"
    assert d.reason.startswith("node1 is cordoned for silent data corruption (silent data "
                               "corruption twice"), d.reason
    assert "resume from /ck/step_150, the newest checkpoint the replicas agreed on, on " \
           "healthy nodes" in d.reason, d.reason
    d = policy.on_corrupting_member(RUN, cordoned=cordoned, pending=plan, sdc_rollback=False)
    assert "resume from /ck/step_150, the pending restart's checkpoint, on healthy nodes" \
        in d.reason and "agreed" not in d.reason, d.reason
    d = policy.on_corrupting_member(RUN, cordoned=cordoned, pending=ResumePlan(checkpoint=None),
                                    sdc_rollback=False)
    assert "the pending restart named no checkpoint" in d.reason, d.reason

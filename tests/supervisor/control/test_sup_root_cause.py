"""A crash's root cause on the incident, and the rule that stops a run on the second identical
failure of the user's code: pure decisions, then through ingest, the store and the API."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from tests.supervisor.sup_helpers import OPERATOR, FakeClock, ingest, register, step
from trainwarden.agent.core import rootcause
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.evaluator import Evaluator

CFG = policy.PolicyConfig()
RUN = policy.RunFacts(id=1, name="r", status="running", attempt=1, restarts=1)


def root(exc: str = "KeyError", line: int = 57, file: str = "/home/u/train.py",
         fn: str = "collate", msg: str = "'label'") -> dict[str, Any]:
    frame = {"file": file, "line": line, "function": fn}
    user = frame if rootcause.is_user_file(file) else None
    return {"exc_type": exc, "message": msg, "frame": frame, "user_frame": user,
            "traceback": f"Traceback (most recent call last):\n  File \"{file}\", line "
                         f"{line}, in {fn}\n{exc}: {msg}", "source": "stderr", "rank": 1,
            "host": "host1"}


def failed(rc: dict[str, Any] | None, code: int | None = 1, sig: int | None = None
           ) -> list[dict[str, Any]]:
    f: dict[str, Any] = {"rank": 1, "local_rank": 1, "exit_code": code, "signal": sig,
                         "pid": 7, "message": "x"}
    if rc is not None:
        f["root_cause"] = rc
    return [f]


def exit_(ranks: list[dict[str, Any]], attempt: int = 1) -> policy.ExitFacts:
    return policy.ExitFacts(id=1, agent_id=1, node="node1", attempt=attempt,
                            outcome="crashed", exit_code=1, signal=None, failed_ranks=ranks)


def fp(rc: dict[str, Any] | None, code: int | None = 1, sig: int | None = None) -> str | None:
    return rootcause.fingerprint(rootcause.from_dict(rc), exit_code=code, signal=sig)


def decide(ex: policy.ExitFacts, previous: str | None, cfg: policy.PolicyConfig = CFG
           ) -> policy.Decision:
    return policy.on_exit(RUN, ex, agent_ids=frozenset({1}), completed_agent_ids=frozenset(),
                          checkpoint="/ck/1", cfg=cfg, now=10.0,
                          recovery=policy.RecoveryFacts(previous_failure=previous))


def test_the_incident_names_the_exception_and_where() -> None:
    d = decide(exit_(failed(root())), previous=None)
    assert isinstance(d, policy.Restart) and d.incident is not None
    assert d.incident.cause.startswith(
        "KeyError: 'label' at train.py:57 in collate (rank 1, host host1)")
    assert d.incident.details["failure_class"] == "user_code"
    assert d.incident.details["fingerprint"] == fp(root())
    assert "Traceback" in d.incident.details["root_cause"]["traceback"]


def test_two_identical_user_code_failures_stop_the_run() -> None:
    d = decide(exit_(failed(root(msg="'label' at another step"))), previous=fp(root()))
    assert isinstance(d, policy.Stop) and d.status == "failed"
    assert "training script" in d.reason and "KeyError" in d.reason
    assert d.incident is not None
    assert d.incident.details["stop_rule"] == policy.STOP_REPEATED_USER_ERROR
    assert d.incident.details["failure_class"] == "user_code"


def test_two_different_user_code_failures_restart() -> None:
    d = decide(exit_(failed(root(line=58))), previous=fp(root()))
    assert isinstance(d, policy.Restart)
    d = decide(exit_(failed(root(exc="ValueError"))), previous=fp(root()))
    assert isinstance(d, policy.Restart)


def test_machine_failures_twice_restart() -> None:
    gloo = root(exc="RuntimeError", msg="[pair.cc:537] Read error: Connection reset by peer")
    assert fp(gloo) is None
    d = decide(exit_(failed(gloo)), previous=fp(gloo))
    assert isinstance(d, policy.Restart)
    assert d.incident is not None and d.incident.details["failure_class"] == "machine"
    killed = failed(None, code=None, sig=9)
    d = decide(exit_(killed), previous=None)
    assert isinstance(d, policy.Restart)
    assert d.incident is not None and d.incident.details["failure_class"] == "machine"
    d = decide(exit_(failed(None)), previous=None)  # no traceback, exit code 1
    assert isinstance(d, policy.Restart)
    assert d.incident is not None and d.incident.details["failure_class"] == "unknown"


def test_the_rule_can_be_turned_off() -> None:
    off = policy.PolicyConfig(stop_on_repeated_user_error=False)
    assert isinstance(decide(exit_(failed(root())), previous=fp(root()), cfg=off),
                      policy.Restart)


# --- through ingest, the store, the evaluator and the API ------------------------------------


def crash_with(attempt: int, rc: dict[str, Any]) -> dict[str, Any]:
    return {"type": "exit", "attempt": attempt, "t": 200.0, "exit_code": 1, "signal": None,
            "outcome": "crashed", "failed_ranks": failed(rc)}


def get(client: TestClient, path: str) -> Any:
    r = client.get(f"/api/v1/runs/r1{path}", headers=OPERATOR)
    assert r.status_code == 200, r.text
    return r.json()


def test_second_identical_failure_stops_the_run_through_the_store(
    client: TestClient, evaluator: Evaluator, clock: FakeClock
) -> None:
    a = register(client, node="node1")["agent_id"]
    ingest(client, a, 0, [step(0, 0), step(1, 0)])
    ingest(client, a, 1, [crash_with(0, root(msg="'label'"))])
    evaluator.tick()
    run = get(client, "")
    assert run["status"] == "restarting" and run["attempt"] == 1
    clock.advance(10)
    # Another step, another message: the same bug at the same line.
    ingest(client, a, 2, [step(0, 5, attempt=1), crash_with(1, root(msg="'label2'"))],
           attempt=1)
    evaluator.tick()
    run = get(client, "")
    assert run["status"] == "failed" and run["restarts"] == 1
    assert "training script" in run["reason"]
    incidents = get(client, "/incidents")["incidents"]
    newest = max(incidents, key=lambda i: i["id"])
    assert newest["failure_class"] == "user_code"
    assert newest["root_cause"]["exc_type"] == "KeyError"
    assert newest["root_cause"]["user_frame"] == {"file": "/home/u/train.py", "line": 57,
                                                  "function": "collate"}
    assert newest["cause"].startswith("KeyError: 'label2' at train.py:57 in collate (rank 1")
    acts = get(client, "/actions")["actions"]
    assert acts[0]["kind"] == "stop" and acts[0]["actor"] == "policy"
    assert "training script" in acts[0]["reason"]


def test_a_hostile_root_cause_is_kept_harmless_and_a_malformed_one_dropped(
    client: TestClient, evaluator: Evaluator
) -> None:
    a = register(client, node="node1")["agent_id"]
    evil = root(msg="\x1b[2J\x00" + "y" * 10_000)
    evil["traceback"] = "z" * 30_000
    bad = {"exc_type": ["not", "text"]}
    ingest(client, a, 0, [step(0, 0), crash_with(0, evil)])
    evaluator.tick()
    inc = get(client, "/incidents")["incidents"][0]
    assert "\x1b" not in inc["cause"] and "\\x1b" in inc["cause"]
    assert len(inc["root_cause"]["traceback"]) <= 8000
    assert len(inc["root_cause"]["message"]) <= 2000
    ingest(client, a, 1, [{**crash_with(1, bad)}], attempt=1)
    evaluator.tick()
    incs = get(client, "/incidents")["incidents"]
    assert len(incs) == 2  # the crash is kept, its unreadable root cause dropped
    assert max(incs, key=lambda i: i["id"])["root_cause"] is None

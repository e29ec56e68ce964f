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


# --- a failure that repeats identically, whatever its class ----------------------------------

USAGE = "t.py: error: argument --inject: invalid choice: 'bogus' (choose from 'crash', 'hang')"


def tail(last: str = USAGE, rank: int = 0) -> dict[str, Any]:
    """What the agent sends for a rank that left no traceback (``from_stderr_tail``)."""
    return {"exc_type": "", "message": last, "frame": None, "user_frame": None,
            "traceback": f"usage: t.py [-h] [--inject {{crash,hang}}]\n{last}",
            "source": "stderr_tail", "rank": rank, "host": "host0"}


def no_traceback(rc: dict[str, Any] | None, *, rank: int = 0, code: int | None = 2,
                 sig: int | None = None, message: str | None = None) -> list[dict[str, Any]]:
    f: dict[str, Any] = {"rank": rank, "local_rank": rank, "exit_code": code, "signal": sig,
                         "pid": 7, "message": USAGE if message is None else message}
    if rc is not None:
        f["root_cause"] = rc
    return [f]


def both_ranks(first: int) -> list[dict[str, Any]]:
    """Both ranks rejected the argument; torchrun names ``first`` (exit 2) and stopped the
    other (SIGTERM) or saw it fail too: which one is a race."""
    other = 1 - first
    return [*no_traceback(tail(rank=first), rank=first),
            {"rank": other, "local_rank": other, "exit_code": -15, "signal": 15, "pid": 8,
             "message": "Signal 15 (SIGTERM) received by PID 8"}]


def exit_at(ranks: list[dict[str, Any]], *, attempt: int = 1,
            steps: dict[int, int] | None = None) -> policy.ExitFacts:
    return policy.ExitFacts(id=1, agent_id=1, node="node0", attempt=attempt,
                            outcome="crashed", exit_code=1, signal=None, failed_ranks=ranks,
                            rank_steps=steps or {})


def signature_of(ex: policy.ExitFacts) -> str | None:
    spec, crash = policy.exit_incident(ex)
    assert crash is not None and spec.details["signature"] == crash.signature
    return crash.signature


def decide_after(ex: policy.ExitFacts, previous: policy.ExitFacts | None,
                 cfg: policy.PolicyConfig = CFG) -> policy.Decision:
    return policy.on_exit(RUN, ex, agent_ids=frozenset({1}), completed_agent_ids=frozenset(),
                          checkpoint="/ck/1", cfg=cfg, now=10.0, recovery=policy.RecoveryFacts(
                              previous_signature=None if previous is None
                              else signature_of(previous)))


def test_a_usage_error_twice_before_the_first_step_stops_the_run() -> None:
    first = exit_at(both_ranks(0), attempt=0)
    d = decide_after(exit_at(both_ranks(0)), None)
    assert isinstance(d, policy.Restart) and d.incident is not None
    # The cause quotes the last line the rank wrote, never torchrun's hint.
    assert d.incident.cause == (f'last stderr line: "{USAGE}" (rank 0, host host0); worker on '
                                f"node node0 rank 0 exited with code 2")
    assert d.incident.details["failure_class"] == "unknown"
    # The node's stderr is both ranks': torchrun naming rank 1 first this time is the same
    # failure.
    d = decide_after(exit_at(both_ranks(1)), first)
    assert isinstance(d, policy.Stop) and d.status == "failed"
    assert d.incident is not None
    assert d.incident.details["stop_rule"] == policy.STOP_IDENTICAL_FAILURE
    assert ("the same failure ended two attempts in a row with no progress between them "
            "(ranks 0, 1, exit code 2, the same last lines of stderr, before the first step)"
            ) in d.reason
    assert USAGE in d.reason and "To enable traceback" not in d.reason
    assert d.incident.details["root_cause"]["traceback"].endswith(USAGE)


def test_the_same_failure_at_the_same_step_stops_and_at_another_step_restarts() -> None:
    first = exit_at(no_traceback(tail("loader: shard 7 is unreadable"), code=1), attempt=0,
                    steps={0: 40, 1: 40})
    again = exit_at(no_traceback(tail("loader: shard 7 is unreadable"), code=1),
                    steps={0: 40, 1: 40})
    assert isinstance(decide_after(again, first), policy.Stop)
    later = exit_at(no_traceback(tail("loader: shard 7 is unreadable"), code=1),
                    steps={0: 90, 1: 90})  # it trained further: progress
    assert isinstance(decide_after(later, first), policy.Restart)
    before = exit_at(no_traceback(tail("loader: shard 7 is unreadable"), code=1))
    assert isinstance(decide_after(before, first), policy.Restart)


def test_a_failure_that_differs_in_rank_code_or_last_line_restarts() -> None:
    first = exit_at(no_traceback(tail()), attempt=0)
    for other in (no_traceback(tail(rank=1), rank=1), no_traceback(tail(), code=1),
                  no_traceback(tail("t.py: error: unrecognized arguments: --x"))):
        assert isinstance(decide_after(exit_at(other), first), policy.Restart), other


def test_the_rule_holds_whatever_the_class() -> None:
    """A failure of the machine's class that repeats identically is not retried either: the
    same last lines (the fabric's error here), the same rank, signal and phase."""
    gloo = root(exc="RuntimeError", msg="NCCL error: unhandled system error", line=9)
    first = exit_at(failed(gloo), attempt=0)
    d = decide_after(exit_at(failed(gloo)), first)
    assert isinstance(d, policy.Stop), d
    assert d.incident is not None and d.incident.details["failure_class"] == "machine"
    assert "the same traceback" in d.reason
    nccl = tail("NCCL error: unhandled system error")
    assert policy.exit_incident(exit_at(no_traceback(nccl, code=1)))[1].failure_class == \
        "machine"  # type: ignore[union-attr]


def test_nothing_left_to_read_is_no_signature() -> None:
    """A rank that wrote nothing (an empty stderr, or an agent that sent no root cause) is
    not called identical: the crash and no-progress budgets still bound it."""
    bare = exit_at(no_traceback(None, message=""), attempt=0)
    assert signature_of(bare) is None
    assert isinstance(decide_after(exit_at(no_traceback(None, message="")), bare),
                      policy.Restart)
    # torchrun's own failure (no rank: its rendezvous) is the membership's matter
    own = [{"rank": None, "exit_code": 1, "launcher": True, "root_cause": tail(rank=0)}]
    assert signature_of(exit_at(own)) is None


def test_an_older_agents_copy_of_torchruns_hint_is_not_the_cause() -> None:
    hint = "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    d = decide_after(exit_at(no_traceback(None, code=1, message=hint)), None)
    assert isinstance(d, policy.Restart) and d.incident is not None
    assert d.incident.cause == "worker on node node0 rank 0 exited with code 1"


def test_the_identical_failure_rule_can_be_turned_off() -> None:
    off = policy.PolicyConfig(stop_on_identical_failure=False)
    first = exit_at(no_traceback(tail()), attempt=0)
    assert isinstance(decide_after(exit_at(no_traceback(tail())), first, cfg=off),
                      policy.Restart)


def test_an_identical_failure_stops_the_run_through_the_store(
    client: TestClient, evaluator: Evaluator, clock: FakeClock
) -> None:
    a = register(client, node="node1")["agent_id"]

    def usage_exit(attempt: int) -> dict[str, Any]:
        return {"type": "exit", "attempt": attempt, "t": 200.0, "exit_code": 1,
                "signal": None, "outcome": "crashed",
                "failed_ranks": no_traceback(tail(), message="")}

    ingest(client, a, 0, [usage_exit(0)])
    evaluator.tick()
    run = get(client, "")
    assert run["status"] == "restarting" and run["attempt"] == 1
    clock.advance(10)
    ingest(client, a, 1, [usage_exit(1)], attempt=1)
    evaluator.tick()
    run = get(client, "")
    assert run["status"] == "failed" and run["restarts"] == 1, run
    assert "no progress between them" in run["reason"] and USAGE in run["reason"]
    newest = max(get(client, "/incidents")["incidents"], key=lambda i: i["id"])
    assert newest["details"]["stop_rule"] == "identical_failure"
    assert newest["root_cause"]["source"] == "stderr_tail"
    assert newest["root_cause"]["traceback"].endswith(USAGE)
    assert newest["cause"].startswith(f'last stderr line: "{USAGE}" (rank 0')
    # The run page says why, with the lines it left.
    page = client.get("/runs/r1", headers=OPERATOR).text
    assert "The same failure (the same rank, exit code, last lines of stderr and step)" in page
    assert "read from stderr_tail" in page and "usage: t.py [-h]" in page


# What rank 1 printed when the DDP example's dcp.save found its checkpoint disk full (the
# shape of the torchrun run in issue 38: DCP raised on every rank, naming only the ranks).
DCP_DISK_FULL = """\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/home/u/examples/train_ddp.py", line 128, in <module>
[rank1]:     main()
[rank1]:   File "/home/u/examples/train_ddp.py", line 117, in main
[rank1]:     dcp.save(state, checkpoint_id=path)
[rank1]:   File "/v/torch/distributed/checkpoint/state_dict_saver.py", line 513, in _save
[rank1]:     metadata = distW.all_reduce("write", write_data, finish_checkpoint)
[rank1]:   File "/v/torch/distributed/checkpoint/utils.py", line 263, in all_reduce
[rank1]:     raise final_result
[rank1]: torch.distributed.checkpoint.api.CheckpointException: CheckpointException \
ranks:dict_keys([0, 1])
[rank1]: Traceback (most recent call last): (RANK 0)
[rank1]:   File "/v/torch/distributed/checkpoint/filesystem.py", line 520, in create_stream
[rank1]:     with path.open(mode) as stream:
[rank1]: OSError: [Errno 28] No space left on device
"""


def test_a_crash_on_a_full_checkpoint_disk_is_the_storages_and_says_so() -> None:
    """Issue 38: classed ``machine`` (DCP raises inside torch.distributed), the incident said
    only ``CheckpointException ranks:dict_keys([0, 1])``."""
    rc = rootcause.from_stderr(DCP_DISK_FULL, rank=1, sole_failure=False)
    assert rc is not None and rc.exc_type.endswith("CheckpointException")
    assert rootcause.storage_failure(rc) == "disk full"
    assert rootcause.classify(rc, exit_code=1) == rootcause.FailureClass.STORAGE
    assert rootcause.fingerprint(rc, exit_code=1) is None  # not the script's bug
    d = decide(exit_(failed(rc.as_dict())), previous=None)
    assert isinstance(d, policy.Restart) and d.incident is not None
    assert d.incident.cause.startswith("checkpoint disk full on node node1: "), d.incident.cause
    assert "(RANK 0: OSError: [Errno 28] No space left on device)" in d.incident.cause
    assert d.incident.details["failure_class"] == "storage"
    read_only = root(exc="OSError", msg="[Errno 30] Read-only file system: '/ck/step_10'")
    assert rootcause.classify(rootcause.from_dict(read_only)) == rootcause.FailureClass.STORAGE
    assert rootcause.storage_failure(rootcause.from_dict(root())) is None
    # A rank killed by a signal is the signal's, whatever it printed before.
    assert rootcause.classify(rc, signal=9) == rootcause.FailureClass.MACHINE

"""A deterministic bug in the training script, end to end: the README's loop under the real
agent and supervisor (torchrun, gloo, 2 ranks on CPU), rank 1 raising KeyError in a helper
at the same step on every attempt.  The run is stopped at the second failure (one restart),
the agent exits with the code of a failed run, and the incident, read from the REST API as a
user would curl it, names the exception, the file and line, rank 1, and says the fault is in
the script.

And a failure with no traceback at all: the DDP example given an ``--inject`` its argparse
rejects (usage printed, exit 2, on both ranks, before the first step).  It repeats
identically, so it is stopped at the second failure too, with argparse's error as the
cause."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.system import OPERATOR_TOKEN, Agent, Supervisor, wait_until
from tests.e2e.torchrun import EXAMPLES
from trainwarden.agent.core.states import AgentExit

pytestmark = pytest.mark.e2e

README_SCRIPT = Path(__file__).with_name("readme_train.py")
BUG_STEP = 40
# The line of the helper's bug (``label_of``'s ``return sample["label"]``).
BUG_LINE = next(i for i, ln in enumerate(README_SCRIPT.read_text().splitlines(), 1)
                if ln.strip() == 'return sample["label"]')


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    # The settings a user gets; only the restart backoff is shortened.
    sup = Supervisor(tmp_path / "sup", env={"TRAINWARDEN_RESTART_BACKOFF_S": "0.5"}).start()
    yield sup
    sup.stop()


def curl(sup: Supervisor, path: str) -> Any:
    r = httpx.get(f"{sup.url}/api/v1{path}", timeout=10,
                  headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"})
    r.raise_for_status()
    return r.json()


def test_a_bug_in_the_script_is_stopped_at_its_second_failure_with_its_traceback(
        supervisor: Supervisor, tmp_path: Path) -> None:
    work = tmp_path / "work"
    agent = Agent(supervisor.url, "keyerror", "node0", work, [
        "--nproc_per_node=2", "--standalone", str(README_SCRIPT), "--wrap", "ddp",
        "--steps", "400", "--seed", "4", "--checkpoint-dir", str(work / "ck"),
        "--checkpoint-every", "0.2", "--key-error-at-step", str(BUG_STEP)])
    try:
        run = wait_until(
            lambda: (r := supervisor.get_or_none("/runs/keyerror")) is not None
            and r["status"] in ("completed", "failed", "stopped") and r,
            240, "the run to end")
        # The agent is told the run failed and says so to whatever wraps it (a Slurm step,
        # a Kubernetes Job): not 0.
        code = agent.wait(60)
    finally:
        agent.stop()
    ctx = f"\nagent:\n{agent.tail()}\nsupervisor:\n{supervisor.tail()}"
    assert run["status"] == "failed", ctx
    assert code == AgentExit.FAILED == 4, (code, ctx)
    assert run["restarts"] == 1 and run["attempt"] == 1, (run, ctx)
    assert "training script" in run["reason"], run["reason"]

    incidents = curl(supervisor, "/runs/keyerror/incidents")["incidents"]
    crashes = sorted((i for i in incidents if i["kind"] == "crash"), key=lambda i: i["id"])
    assert [i["attempt"] for i in crashes] == [0, 1], (incidents, ctx)
    for inc in crashes:
        assert inc["failure_class"] == "user_code", inc
        rc = inc["root_cause"]
        assert rc["exc_type"] == "KeyError" and rc["message"] == "'label'", rc
        assert rc["rank"] == 1 and inc["rank"] == 1
        assert rc["user_frame"]["file"].endswith("readme_train.py"), rc
        assert rc["user_frame"]["line"] == BUG_LINE and rc["user_frame"]["function"] == \
            "label_of", rc
        assert 'return sample["label"]' in rc["traceback"], rc["traceback"]
        assert inc["cause"].startswith(
            f"KeyError: 'label' at readme_train.py:{BUG_LINE} in label_of (rank 1, host "), inc
        # The step is the one after the rank's newest stored report: unknown (None) when
        # the exit is judged before that attempt's step reports are stored.
        assert inc["step"] in (BUG_STEP, None), inc
    assert crashes[1]["details"]["stop_rule"] == "repeated_user_error"
    assert crashes[0]["details"]["fingerprint"] == crashes[1]["details"]["fingerprint"]

    acts = sorted(curl(supervisor, "/runs/keyerror/actions")["actions"], key=lambda a: a["id"])
    assert [(a["kind"], a["actor"]) for a in acts] == [("restart", "policy"),
                                                       ("stop", "policy")], acts
    assert "KeyError" in acts[1]["reason"]


def test_a_rejected_argument_is_stopped_at_its_second_failure_with_the_usage_error(
        supervisor: Supervisor, tmp_path: Path) -> None:
    work = tmp_path / "work"
    agent = Agent(supervisor.url, "usage", "node0", work, [
        "--nproc_per_node=2", "--standalone", str(EXAMPLES / "train_ddp.py"),
        "--steps", "50", "--checkpoint-dir", str(work / "ck"), "--inject", "explode@10"])
    try:
        run = wait_until(
            lambda: (r := supervisor.get_or_none("/runs/usage")) is not None
            and r["status"] in ("completed", "failed", "stopped") and r,
            180, "the run to end")
    finally:
        agent.stop()
    ctx = f"\nagent:\n{agent.tail()}\nsupervisor:\n{supervisor.tail()}"
    assert run["status"] == "failed", ctx
    assert run["restarts"] == 1 and run["attempt"] == 1, (run, ctx)
    error = "error: argument --inject: --inject 'explode@10': expected KIND@STEP"
    assert "no progress between them" in run["reason"] and error in run["reason"], run
    assert "To enable traceback" not in run["reason"]

    incidents = curl(supervisor, "/runs/usage/incidents")["incidents"]
    crashes = sorted((i for i in incidents if i["kind"] == "crash"), key=lambda i: i["id"])
    assert [i["attempt"] for i in crashes] == [0, 1], (incidents, ctx)
    for inc in crashes:
        assert error in inc["cause"] and "To enable traceback" not in inc["cause"], inc
        assert inc["cause"].startswith('last stderr line: "train_ddp.py: error: argument '
                                       "--inject:"), inc["cause"]
        assert inc["exit_code"] == 2, inc
        assert inc["step"] is None, inc  # before the first step
        rc = inc["root_cause"]
        assert rc["source"] == "stderr_tail" and rc["exc_type"] == "", rc
        assert "usage: train_ddp.py" in rc["traceback"] and error in rc["traceback"], rc
    assert crashes[0]["details"]["signature"] == crashes[1]["details"]["signature"]
    assert crashes[1]["details"]["stop_rule"] == "identical_failure"

    acts = sorted(curl(supervisor, "/runs/usage/actions")["actions"], key=lambda a: a["id"])
    assert [(a["kind"], a["actor"]) for a in acts] == [("restart", "policy"),
                                                       ("stop", "policy")], acts

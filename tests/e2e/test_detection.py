"""Each fault of the catalogue, injected into a real torchrun run under agent and supervisor,
is detected, named (kind, rank, step) and handled as the policy says."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.system import Agent, Supervisor, ddp_script, wait_until
from tests.e2e.torchrun import EXAMPLES

pytestmark = pytest.mark.e2e

TRAIN = ["--hidden", "32", "--seed", "2", "--checkpoint-every-steps", "50"]


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    # Short deadlines so tests are quick: a hang after 6 s without progress.
    # Detection on its own: spikes and NaN open incidents without the automatic rollback
    # (tests/e2e/test_recovery.py covers that).
    sup = Supervisor(tmp_path_factory.mktemp("sup"), env={
        "TRAINWARDEN_HANG_FLOOR_S": "6", "TRAINWARDEN_HANG_WARMUP_S": "20",
        "TRAINWARDEN_HANG_STARTUP_S": "120", "TRAINWARDEN_RESTART_BACKOFF_S": "0.5",
        "TRAINWARDEN_ROLLBACK_BUDGET": "0"}).start()
    yield sup
    sup.stop()


def run_to_end(sup: Supervisor, tmp_path: Path, name: str, *args: str,
               timeout: float = 240) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    work = tmp_path / name
    agent = Agent(sup.url, name, "node0", work, [
        "--nproc_per_node=2", "--standalone", *ddp_script(
            *TRAIN, "--checkpoint-dir", str(work / "ck"),
            "--summary-json", str(work / "summary.json"), *args)])
    try:
        assert agent.wait(timeout) == 0, agent.tail()
    finally:
        agent.stop()
    try:
        run = wait_until(lambda: (r := sup.get(f"/runs/{name}"))["status"] in
                         ("completed", "failed", "stopped") and r, 15, "the run to end")
    except AssertionError:
        raise AssertionError(f"run did not end: {sup.get(f'/runs/{name}')}\n"
                             f"{sup.get(f'/runs/{name}/incidents')}\n{sup.tail()}") from None
    return run, sup.get(f"/runs/{name}/incidents")["incidents"]


def test_hang_is_detected_stacks_captured_and_the_gang_restarted(
        supervisor: Supervisor, tmp_path: Path) -> None:
    # Rank 1 stops making progress at step 150; rank 0 waits in the all-reduce (a 60 s
    # collective timeout: the hang deadline is shorter).
    run, incidents = run_to_end(supervisor, tmp_path, "hangs", "--steps", "260",
                                "--step-sleep", "0.005", "--inject", "hang@150:rank=1")
    assert run["status"] == "completed" and run["restarts"] == 1, run
    (inc,) = incidents
    assert inc["kind"] == "hang" and inc["step"] == 149 and inc["attempt"] == 0
    stacks = inc["details"]["stacks"]
    assert sorted(stacks) == ["0", "1"]
    assert "in before_step" in stacks["1"]  # the stuck line of the hung rank...
    assert "backward" in stacks["0"]  # ...and its peer waiting in the gradient all-reduce
    # Both ranks stopped after step 149 (nobody behind): the stacks name the culprit.
    assert inc["details"]["behind"] == {}
    assert (inc["rank"], inc["node"]) == (1, "node0"), inc
    assert inc["details"]["culprit"]["ranks"] == [1]
    assert "rank 1 is not in a collective (before_step" in inc["cause"]
    stall = inc["details"]["stall_s"]
    assert 6 <= stall < 12, stall  # caught right after the 6 s deadline
    (act,) = supervisor.get("/runs/hangs/actions")["actions"]
    assert act["status"] == "resumed" and act["resumed_step"] == 150
    assert act["plan"]["checkpoint"].endswith("step_150")


def test_an_fsdp2_hang_names_the_rank_outside_the_collective(
        supervisor: Supervisor, tmp_path: Path) -> None:
    """Rank 1 stops before step 60; rank 0 waits in FSDP2's all-gather of the next forward.
    Both last reported step 59, and the incident names rank 1 and its node from the stacks
    (the agent is stopped once it does: the restart itself is the DDP test's)."""
    work = tmp_path / "fsdp-hang"
    agent = Agent(supervisor.url, "fsdp-hang", "node0", work, [
        "--nproc_per_node=2", "--standalone", str(EXAMPLES / "train_fsdp.py"), *TRAIN,
        "--checkpoint-dir", str(work / "ck"), "--steps", "400", "--step-sleep", "0.005",
        "--inject", "hang@60:rank=1"])
    try:
        def named() -> dict[str, Any] | None:
            got = supervisor.get_or_none("/runs/fsdp-hang/incidents")  # None: not registered
            return next((i for i in (got or {}).get("incidents", []) if i["kind"] == "hang"
                         and (i["details"] or {}).get("culprit")), None)

        inc = wait_until(named, 120, "the hang incident with its culprit")
    finally:
        agent.stop()
    assert inc["step"] == 59 and inc["details"]["behind"] == {}, inc
    assert (inc["rank"], inc["node"]) == (1, "node0"), inc
    per_rank = inc["details"]["culprit"]["per_rank"]
    assert per_rank["0"]["state"] == "collective" and "_fsdp" in inc["details"]["stacks"]["0"]
    assert per_rank["1"]["state"] == "elsewhere"
    assert per_rank["1"]["where"].startswith("before_step")


def test_collective_timeout_is_an_incident_naming_rank_and_collective(
        supervisor: Supervisor, tmp_path: Path) -> None:
    run, incidents = run_to_end(supervisor, tmp_path, "timeouts", "--steps", "160",
                                "--timeout", "2", "--inject", "hang@120:rank=1")
    assert run["status"] == "completed" and run["restarts"] == 1, run
    (inc,) = incidents
    assert inc["kind"] == "collective_timeout" and inc["rank"] == 0, inc
    assert inc["details"]["collective"].startswith("all_reduce")
    assert "Timed out" in inc["cause"] and "2000ms" in inc["cause"]


def test_straggler_is_named_without_a_restart(supervisor: Supervisor, tmp_path: Path) -> None:
    """Rank 1 twice as slow before the collective from step 100: one straggler incident naming
    it, within 50 steps, and no restart.  (A 1.5x straggler scores about 0.67 against the 0.75
    threshold: on a CPU shared with busy processes its 20-step median wandered over the
    threshold, flagged it 60 steps late, and once read healthy for a whole hold window: two
    incidents.  The threshold's behaviour is pinned by the detector's unit tests.)"""
    run, incidents = run_to_end(supervisor, tmp_path, "slow", "--steps", "260",
                                "--step-sleep", "0.02", "--inject", "slow@100:rank=1:factor=2")
    assert run["status"] == "completed" and run["restarts"] == 0, run
    assert [i["kind"] for i in incidents] == ["straggler"], incidents
    inc = incidents[0]
    assert inc["rank"] == 1 and inc["node"] == "node0"
    assert 100 <= inc["step"] <= 150, inc  # named within 50 steps of the slowdown
    flagged = inc["details"]["flagged_at_step"]
    assert flagged <= 150, flagged
    assert re.search(r"rank 1", inc["cause"])


def test_a_final_evaluation_longer_than_the_hang_deadline_is_not_a_hang(
        supervisor: Supervisor, tmp_path: Path) -> None:
    """After its last step the script evaluates for twice the 6 s hang floor: the loop's end
    was reported (Checkpointer.close), so that is teardown, not a hang to restart."""
    run, incidents = run_to_end(supervisor, tmp_path, "long-eval", "--steps", "60",
                                "--eval-sleep", "12")
    assert incidents == []
    assert run["status"] == "completed"
    assert run["restarts"] == 0


def test_loss_spike_and_nan_open_incidents_and_their_last_good_checkpoints_are_kept(
        supervisor: Supervisor, tmp_path: Path) -> None:
    """No automatic rollback here: the incidents stay open, and the last good checkpoint
    before each (what an operator would roll back to) outlives the workers' retention (keep 3,
    a 4 s grace) because the supervisor has the agent pin it."""
    run, incidents = run_to_end(supervisor, tmp_path, "spiky", "--steps", "900",
                                "--step-sleep", "0.01", "--retention-grace", "4",
                                "--inject", "spike@120", "--inject", "nan@220")
    assert run["status"] == "completed" and run["restarts"] == 0, run
    by_kind = {i["kind"]: i for i in incidents}
    assert sorted(by_kind) == ["loss_spike", "nonfinite"], incidents
    assert by_kind["loss_spike"]["step"] == 120
    assert by_kind["nonfinite"]["step"] == 220
    summary = json.loads((tmp_path / "spiky" / "summary.json").read_text())
    assert summary["final_train_loss"] != summary["final_train_loss"]  # NaN: nothing fixed it
    ck = tmp_path / "spiky" / "ck"
    # the newest checkpoint 10 steps or more before each: step 100 and step 200
    assert sorted(run["protected"]) == [str(ck / "step_100"), str(ck / "step_200")], run
    for step in (100, 200):
        assert "protected by the supervisor" in (ck / f"step_{step}" / "PINNED").read_text()
    kept = {p.name for p in ck.iterdir() if p.name.startswith("step_")}
    assert not kept & {"step_50", "step_150"}, kept  # retention went on

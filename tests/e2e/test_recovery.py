"""Recovery end to end: a loss spike or NaN is rolled back past, its batches skipped and the
LR lowered for a while; an operator does the same by hand; a spike that keeps coming back
stops the run."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.system import OPERATOR_TOKEN, REPO, Agent, Supervisor, ddp_script, wait_until
from tests.e2e.torchrun import effective_history, read_batch_logs, run_example
from trainwarden.agent.core.states import AgentExit
from trainwarden.supervisor.control.policy import PolicyConfig
from trainwarden.supervisor.detect import LossSpikeConfig

pytestmark = pytest.mark.e2e

LR = 2e-3
# Checkpoints every 50 steps (a fraction of a second here, far more often than in a real run)
# and the default retention (keep 3): the checkpoint before a spike falls out of the newest
# three before detection has run; the retention grace keeps it until the supervisor pins it.
TRAIN = ["--hidden", "32", "--seed", "2", "--checkpoint-every-steps", "50", "--lr", str(LR)]
# The rollback settings a user gets; only the restart backoff is shortened.
SUPERVISOR_ENV = {"TRAINWARDEN_RESTART_BACKOFF_S": "0.5"}
WINDOW = LossSpikeConfig().recovery_window_steps
LR_RATIO = PolicyConfig().rollback_lr_ratio


@pytest.fixture(scope="module")
def supervisor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Supervisor]:
    sup = Supervisor(tmp_path_factory.mktemp("sup"), env=SUPERVISOR_ENV).start()
    yield sup
    sup.stop()


def under_trainwarden(sup: Supervisor, work: Path, name: str, *args: str,
                      timeout: float = 300) -> Agent:
    return Agent(sup.url, name, "node0", work, [
        "--nproc_per_node=2", "--standalone", *ddp_script(
            *TRAIN, "--checkpoint-dir", str(work / "ck"), "--summary-json",
            str(work / "summary.json"), "--batch-log", str(work / "batches"), *args)])


def ended(sup: Supervisor, name: str) -> dict[str, Any]:
    run: dict[str, Any] = wait_until(
        lambda: (r := sup.get(f"/runs/{name}"))["status"] in ("completed", "failed", "stopped")
        and r, 20, f"run {name} to end")
    return run


def finish(agent: Agent, timeout: float = 300, code: int = AgentExit.COMPLETED) -> None:
    """The agent ends on its own, with the exit code of how the run ended."""
    try:
        assert agent.wait(timeout) == code, agent.tail()
    finally:
        agent.stop()


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    """The clean run's held-out loss after 400 and after 600 steps (one 600-step run: the
    LR is constant, so its weights at step 400 are a 400-step run's final weights)."""
    work = tmp_path_factory.mktemp("clean")
    run = run_example("train_ddp.py", work, "--steps", "600", "--eval-at", "400", *TRAIN,
                      "--checkpoint-dir", str(work / "ck"))
    assert run.summary, run.output[-2000:]
    return {400: run.summary["eval_at"]["400"], 600: run.summary["final_eval_loss"]}


@pytest.mark.parametrize(("steps", "at", "target"), [(400, 200, 0.05), (600, 300, 0.02)])
def test_spike_is_rolled_back_skipped_and_the_run_ends_as_well_as_a_clean_one(
        supervisor: Supervisor, clean: dict[str, float], tmp_path: Path, steps: int, at: int,
        target: float) -> None:
    """20 corrupted batches in the middle of the run, the default settings: the spike is
    called once it has not come back within the recovery window, the run rolls back to the
    checkpoint before it, skips what was seen (from a few batches before the spike through
    where it was detected) and lowers the LR for a quarter as many steps."""
    length = ["--steps", str(steps)]
    plain_dir, tw_dir = tmp_path / "plain", tmp_path / "tw"
    plain_dir.mkdir()
    plain = run_example("train_ddp.py", plain_dir, *length, *TRAIN, "--inject", f"spike@{at}",
                        "--checkpoint-dir", str(plain_dir / "ck"), max_restarts=3)
    name = f"spike{steps}"
    agent = under_trainwarden(supervisor, tw_dir, name, *length, "--inject", f"spike@{at}")
    finish(agent)
    assert plain.summary, plain.output[-2000:]
    run = ended(supervisor, name)
    assert run["status"] == "completed" and run["restarts"] == 1, run
    (inc,) = supervisor.get(f"/runs/{name}/incidents")["incidents"]
    assert inc["kind"] == "loss_spike" and inc["step"] == at, inc
    detected = inc["details"]["detected_at_step"]
    assert at < detected <= at + WINDOW + 10, inc  # caught within the window + 10 steps
    (act,) = supervisor.get(f"/runs/{name}/actions")["actions"]
    assert act["cause"] == "spike" and act["status"] == "resumed"
    back_to = at - 50  # the newest checkpoint <= at - 10
    assert act["plan"]["checkpoint"].endswith(f"step_{back_to}")
    assert act["resumed_step"] == back_to  # it was still there: kept, then pinned
    # Skipped: from 10 batches before the spike through the batch of its detection.
    assert act["plan"]["skip"] == [[at - 10, detected]]
    skipped = detected - (at - 10) + 1
    lr_steps = math.ceil(LR_RATIO * skipped)
    assert act["plan"]["lr"] == {"scale": 0.5, "steps": lr_steps, "ramp_steps": lr_steps // 2}
    summary = json.loads((tw_dir / "summary.json").read_text())

    for rank, rows in read_batch_logs(tw_dir / "batches").items():
        hist = effective_history(rows)
        trained = set(hist.values())
        # The corrupted batches are never in the final weights' history...
        assert not trained & set(range(at, at + 20)), rank
        # ...nor anything else of the skip range; every other batch once, in order.
        after = [hist[s] for s in range(back_to, steps)]
        assert after == (list(range(back_to, at - 10))
                         + list(range(detected + 1, detected + 1 + steps - (at - 10)))), rank
        # The LR after the rollback: x0.5 for lr_steps, then a linear ramp back.
        lrs = {s: lr for a, s, _, lr in rows if a == "1.0"}
        ramp = lr_steps // 2
        assert lrs[back_to] == pytest.approx(LR * 0.5)
        assert lrs[back_to + lr_steps - 1] == pytest.approx(LR * 0.5)
        assert lrs[back_to + lr_steps] == pytest.approx(LR * (0.5 + 0.5 / ramp))
        assert lrs[back_to + lr_steps + ramp - 1] == pytest.approx(LR)
        assert lrs[steps - 1] == pytest.approx(LR)

    c, p, t = clean[steps], plain.summary["final_eval_loss"], summary["final_eval_loss"]
    print(f"\n{steps} steps, spike at {at}: final eval loss: clean {c:.4f}, trainwarden "
          f"{t:.4f} ({(t / c - 1) * 100:+.1f}%), plain torchrun --max-restarts=3 {p:.4f} "
          f"({(p / c - 1) * 100:+.1f}%)")
    assert t / c - 1 <= target, (c, t)
    assert p > 3 * c, (c, p)  # plain torchrun does not notice: the run stays damaged


def test_nan_is_rolled_back_and_the_run_ends_finite(supervisor: Supervisor,
                                                    tmp_path: Path) -> None:
    # Paced (30 ms a step, 5 s of training after the NaN): unpaced, a fast machine trained
    # all 400 steps in 1.1 s, and the run ended on its NaN weights before the rollback the
    # supervisor had decided could reach the agent.
    agent = under_trainwarden(supervisor, tmp_path, "nan", "--steps", "400",
                              "--step-sleep", "0.03", "--inject", "nan@220")
    finish(agent)
    run = ended(supervisor, "nan")
    assert run["status"] == "completed" and run["restarts"] == 1, run
    (inc,) = supervisor.get("/runs/nan/incidents")["incidents"]
    assert inc["kind"] == "nonfinite" and inc["step"] == 220
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_eval_loss"] < 1.0  # finite and trained
    assert summary["skipped"] == [[210, 220]]  # a few batches before the NaN, through it


def test_spike_that_keeps_coming_back_spends_the_budget_and_stops_the_run(
        tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "sup", env={**SUPERVISOR_ENV,
                                            "TRAINWARDEN_ROLLBACK_BUDGET": "2"}).start()
    try:
        # Every batch from 200 on is corrupt: no skip range can get past it.
        agent = under_trainwarden(sup, tmp_path, "doomed", "--steps", "600",
                                  "--inject", "spike@200:len=100000")
        finish(agent, code=AgentExit.FAILED)  # a job wrapping it fails too
        run = ended(sup, "doomed")
        assert run["status"] == "failed", run
        assert "rollback budget of 2 spent" in run["reason"] or "no progress" in run["reason"]
        rollbacks = [a for a in sup.get("/runs/doomed/actions")["actions"]
                     if a["kind"] == "restart"]
        assert len(rollbacks) == 2
        skips = sorted(a["plan"]["skip"][0] for a in rollbacks)
        assert skips[1][1] - skips[1][0] > skips[0][1] - skips[0][0]  # widened
        scales = sorted(a["plan"]["lr"]["scale"] for a in rollbacks)
        assert scales == [0.25, 0.5]  # lowered further
        stops = [a for a in sup.get("/runs/doomed/actions")["actions"] if a["kind"] == "stop"]
        assert len(stops) == 1 and stops[0]["actor"] == "policy"
        # What the TrainwardenRunFailed alert reads: the failed status, the spike budget gone.
        metrics = httpx.get(f"{sup.url}/metrics", timeout=10,
                            headers={"Authorization": f"Bearer {OPERATOR_TOKEN}"}).text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for fam in text_string_to_metric_families(metrics) for s in fam.samples}
        assert samples[("trainwarden_run_info", (("run", "doomed"), ("status", "failed")))] == 1
        assert samples[("trainwarden_run_restart_budget_remaining",
                        (("cause", "spike"), ("run", "doomed")))] == 0
    finally:
        sup.stop()


def cli(sup: Supervisor, *args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "trainwarden.supervisor.cli", *args, "--supervisor",
                          sup.url, "--token", OPERATOR_TOKEN], capture_output=True, text=True,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_operator_rollback_through_the_cli(supervisor: Supervisor, tmp_path: Path) -> None:
    agent = under_trainwarden(supervisor, tmp_path, "manual", "--steps", "900",
                              "--step-sleep", "0.01")
    try:
        wait_until(lambda: ((supervisor.get_or_none("/runs/manual") or {}).get("step") or 0)
                   >= 320, 120, "training past step 320")
        table = cli(supervisor, "checkpoints", "manual")
        assert "step_200" in table and "complete" in table
        out = cli(supervisor, "rollback", "manual", "--to", "200", "--skip", "230-259",
                  "--lr-scale", "0.5", "--lr-steps", "20", "--lr-ramp-steps", "10",
                  "--reason", "suspicious shard", "--wait", "90")
        assert "resumed at step 200" in out, out
    finally:
        finish(agent)
    run = ended(supervisor, "manual")
    assert run["status"] == "completed" and run["attempt"] == 1  # outside the budgets
    (act,) = supervisor.get("/runs/manual/actions")["actions"]
    assert act["actor"] == "operator" and act["reason"] == "suspicious shard"
    rows = read_batch_logs(tmp_path / "batches")[0]
    after = [(s, i, lr) for a, s, i, lr in rows if a == "1.0"]
    assert after[0][:2] == (200, 200)
    steps = {s: (i, lr) for s, i, lr in after}
    assert steps[229][0] == 229 and steps[230][0] == 260  # 230-259 skipped
    assert steps[219][1] == pytest.approx(LR * 0.5) and steps[229][1] == pytest.approx(LR)
    assert "manual" in cli(supervisor, "runs") and "operator" in cli(supervisor, "actions",
                                                                        "manual")

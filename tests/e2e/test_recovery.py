"""Recovery end to end: a loss spike or NaN is rolled back past, its batches skipped and the
LR lowered for a while; an operator does the same by hand; a spike that keeps coming back
stops the run."""

from __future__ import annotations

import json
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

pytestmark = pytest.mark.e2e

LR = 2e-3
# Checkpoints every 50 steps (a fraction of a second here, far more often than in a real run)
# and the default retention (keep 3): the checkpoint before a spike falls out of the newest
# three before detection has run; the retention grace keeps it until the supervisor pins it.
TRAIN = ["--hidden", "32", "--seed", "2", "--checkpoint-every-steps", "50", "--lr", str(LR)]
# Rollback defaults scaled for a 600-step run: LR x0.5 for 30 steps, back over 20.
SUPERVISOR_ENV = {"TRAINWARDEN_ROLLBACK_LR_STEPS": "30",
                  "TRAINWARDEN_ROLLBACK_LR_RAMP_STEPS": "20",
                  "TRAINWARDEN_RESTART_BACKOFF_S": "0.5"}


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


def finish(agent: Agent, timeout: float = 300) -> None:
    try:
        assert agent.wait(timeout) == 0, agent.tail()
    finally:
        agent.stop()


def test_spike_is_rolled_back_skipped_and_the_run_ends_as_well_as_a_clean_one(
        supervisor: Supervisor, tmp_path: Path) -> None:
    steps = ["--steps", "600"]
    clean_dir, plain_dir, tw_dir = (tmp_path / d for d in ("clean", "plain", "tw"))
    for d in (clean_dir, plain_dir):
        d.mkdir()
    clean = run_example("train_ddp.py", clean_dir, *steps, *TRAIN,
                        "--checkpoint-dir", str(clean_dir / "ck"))
    plain = run_example("train_ddp.py", plain_dir, *steps, *TRAIN, "--inject", "spike@300",
                        "--checkpoint-dir", str(plain_dir / "ck"), max_restarts=3)
    agent = under_trainwarden(supervisor, tw_dir, "spike", *steps, "--inject", "spike@300")
    finish(agent)
    assert clean.summary and plain.summary, (clean.output[-2000:], plain.output[-2000:])
    run = ended(supervisor, "spike")
    assert run["status"] == "completed" and run["restarts"] == 1, run
    (inc,) = supervisor.get("/runs/spike/incidents")["incidents"]
    assert inc["kind"] == "loss_spike" and inc["step"] == 300, inc
    (act,) = supervisor.get("/runs/spike/actions")["actions"]
    assert act["cause"] == "spike" and act["status"] == "resumed"
    assert act["plan"]["checkpoint"].endswith("step_250")  # newest <= 300 - 10
    assert act["resumed_step"] == 250  # it was still there: kept, then pinned
    assert act["plan"]["skip"] == [[290, 389]]
    assert act["plan"]["lr"] == {"scale": 0.5, "steps": 30, "ramp_steps": 20}
    summary = json.loads((tw_dir / "summary.json").read_text())

    for rank, rows in read_batch_logs(tw_dir / "batches").items():
        hist = effective_history(rows)
        trained = set(hist.values())
        # The corrupted batches 300-319 are never in the final weights' history...
        assert not trained & set(range(300, 320)), rank
        # ...nor anything else of the skip range; every other batch once, in order.
        after = [hist[s] for s in range(250, 600)]
        assert after == list(range(250, 290)) + list(range(390, 700)), rank
        # The LR after the rollback: x0.5 for 30 steps, then a linear ramp back over 20.
        lrs = {s: lr for a, s, _, lr in rows if a == "1.0"}
        assert lrs[250] == pytest.approx(LR * 0.5) and lrs[279] == pytest.approx(LR * 0.5)
        assert lrs[280] == pytest.approx(LR * (0.5 + 0.5 / 20))
        assert lrs[299] == pytest.approx(LR) and lrs[599] == pytest.approx(LR)

    c, p, t = (s["final_eval_loss"] for s in (clean.summary, plain.summary, summary))
    print(f"\nfinal eval loss: clean {c:.4f}, trainwarden after the spike {t:.4f} "
          f"({(t / c - 1) * 100:+.1f}%), plain torchrun --max-restarts=3 {p:.4f} "
          f"({(p / c - 1) * 100:+.1f}%)")
    assert abs(t / c - 1) <= 0.05, (c, t)
    assert p > 3 * c, (c, p)  # plain torchrun does not notice: the run stays damaged


def test_nan_is_rolled_back_and_the_run_ends_finite(supervisor: Supervisor,
                                                    tmp_path: Path) -> None:
    agent = under_trainwarden(supervisor, tmp_path, "nan", "--steps", "400",
                              "--inject", "nan@220")
    finish(agent)
    run = ended(supervisor, "nan")
    assert run["status"] == "completed" and run["restarts"] == 1, run
    (inc,) = supervisor.get("/runs/nan/incidents")["incidents"]
    assert inc["kind"] == "nonfinite" and inc["step"] == 220
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_eval_loss"] < 1.0  # finite and trained
    assert summary["skipped"] == [[210, 309]]


def test_spike_that_keeps_coming_back_spends_the_budget_and_stops_the_run(
        tmp_path: Path) -> None:
    sup = Supervisor(tmp_path / "sup", env={**SUPERVISOR_ENV,
                                            "TRAINWARDEN_ROLLBACK_BUDGET": "2",
                                            "TRAINWARDEN_ROLLBACK_SKIP_BATCHES": "40"}).start()
    try:
        # Every batch from 200 on is corrupt: no skip range can get past it.
        agent = under_trainwarden(sup, tmp_path, "doomed", "--steps", "600",
                                  "--inject", "spike@200:len=100000")
        finish(agent)
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
    out = subprocess.run([sys.executable, "-m", "supervisor.cli", *args, "--supervisor",
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

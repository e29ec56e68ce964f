"""`make demo` as a user runs it (examples/demo.py with its default run and faults), told only
to exit once the run has ended and where to keep its data and which port to take (so it
cannot clash with anything else on the machine): the crash is restarted from a checkpoint, the
loss spike rolled back past its batches, and the run completes."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.torchrun import worker_env

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
DEMO = Path(__file__).resolve().parents[2] / "examples" / "demo.py"


def test_the_demo_restarts_the_crash_rolls_back_the_spike_and_completes(tmp_path: Path) -> None:
    data = tmp_path / "demo-data"
    proc = subprocess.run([sys.executable, str(DEMO), "--exit-when-done", "--data-dir",
                           str(data), "--port", "0"], env=worker_env(), capture_output=True,
                          text=True, timeout=540)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    assert "run demo: completed" in out, out[-3000:]
    # What happened is read from the demo's database (what the dashboard shows), not from
    # the lines the demo prints while it polls: a poll may miss a short-lived state.
    db = sqlite3.connect(f"file:{data / 'trainwarden.db'}?mode=ro", uri=True)
    db.row_factory = sqlite3.Row
    (run,) = db.execute("SELECT id, status FROM runs WHERE name = 'demo'").fetchall()
    assert run["status"] == "completed"
    incidents = {i["kind"]: i for i in db.execute(
        "SELECT * FROM incidents WHERE run_id = ? AND kind IN ('crash', 'loss_spike')",
        (run["id"],))}
    assert set(incidents) == {"crash", "loss_spike"}, list(incidents)
    crash = incidents["crash"]
    assert crash["rank"] == 1, dict(crash)
    assert "killed by signal 9" in crash["cause"], crash["cause"]
    spike = incidents["loss_spike"]
    assert spike["step"] == 2000, dict(spike)

    def restart_for(incident: sqlite3.Row) -> sqlite3.Row:
        (act,) = db.execute("SELECT * FROM actions WHERE incident_id = ? AND kind = 'restart'",
                            (incident["id"],)).fetchall()
        assert act["status"] == "resumed", dict(act)
        return act

    crash_restart = restart_for(crash)
    assert crash_restart["resumed_step"] <= crash["step"], dict(crash_restart)
    rollback = restart_for(spike)
    back = rollback["rollback_to_step"]
    plan = json.loads(rollback["plan"])
    ((first, last),) = plan["skip"]
    # The corrupted batches (2000-2019) are all skipped, from a checkpoint before them.
    assert back <= 1990, dict(rollback)
    assert rollback["resumed_step"] == back, dict(rollback)
    assert first <= 2000 and last >= 2019, plan["skip"]
    assert plan["lr"]["scale"] == 0.5, plan["lr"]
    summary = json.loads((data / "summary.json").read_text())
    assert summary["final_step"] == 3000, summary
    assert summary["started_at_step"] == back, summary
    assert summary["skipped"] == [[first, last]], summary
    # The dashboard's steps after the rollback are the final lineage's: the old attempt
    # trained on past the rollback point until the restart reached it (the spike in it), and
    # none of its rows is merged into a step the new attempt trained (one attempt's 2 ranks
    # and one step's samples a step; the healthy loss).
    lineage = dashboard_steps(data)
    per_step = {p["samples"] // p["rows"] for p in lineage["points"]}
    assert len(per_step) == 1, per_step
    assert all(p["ranks"] == 2 * p["rows"] for p in lineage["points"]), lineage["points"][:5]
    after = [p for p in lineage["points"] if p["step_from"] >= back]
    assert after and {p["attempt"] for p in after} == {rollback["attempt"]}
    assert max(p["loss_mean"] for p in after) < 1.0, max(p["loss_mean"] for p in after)
    old = [p for p in lineage["superseded"] if p["attempt"] == rollback["attempt"] - 1]
    assert min(p["step_from"] for p in old) == back, old[:3]
    assert max(p["loss_max"] for p in old) > 1000  # the spike, drawn apart


def dashboard_steps(data: Path) -> dict[str, Any]:
    """What the run page's charts read (``/api/v1/runs/demo/steps?max_points=1000``), from
    the real app on the demo's database."""
    from fastapi.testclient import TestClient

    from trainwarden.supervisor.config import SupervisorSettings
    from trainwarden.supervisor.server.app import create_app
    from trainwarden.supervisor.store.db import make_database

    db = make_database(f"sqlite:///{data / 'trainwarden.db'}")
    try:
        settings = SupervisorSettings(agent_token="agent", operator_token="operator")
        app = create_app(settings, db=db, upgrade_schema=False, start_evaluator=False)
        with TestClient(app) as client:
            r = client.get("/api/v1/runs/demo/steps?max_points=1000",
                           headers={"Authorization": "Bearer operator"})
            assert r.status_code == 200, r.text
            out: dict[str, Any] = r.json()
            return out
    finally:
        db.dispose()

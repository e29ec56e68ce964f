"""A 100,000-step run's page and chart feeds stay small and fast (server-side downsampling,
bounded tables and rank windows)."""

from __future__ import annotations

import time

from fastapi.testclient import TestClient

from tests.dashboard.apps import T0
from tests.dashboard.synth import OPERATOR, SynthRun
from trainwarden.supervisor.store.db import Database
from trainwarden.supervisor.store.tables import step_aggregates

STEPS = 100_000


def test_a_100k_step_run_loads_fast(client: TestClient, db: Database) -> None:
    run = SynthRun(client, "long", nodes=1, ranks_per_node=2).register()
    run.train(range(STEPS - 40, STEPS), t0=T0)  # the newest steps through the API
    rows = [{"run_id": 1, "attempt": 0, "step": s, "ranks": 2, "loss_sum": 4.0,
             "loss_count": 2, "loss_min": 2.0, "loss_max": 2.0, "loss_nonfinite": 0,
             "grad_norm_nonfinite": 0, "samples": 16, "tokens": 2048, "step_s_max": 0.25,
             "t_first": T0 + s, "t_last": T0 + s} for s in range(STEPS - 40)]
    with db.write() as conn:  # the history in bulk (the API would take minutes)
        conn.execute(step_aggregates.insert(), rows)
    for path, limit_s, max_bytes in (
            ("/runs/long", 1.0, 200_000),
            ("/api/v1/runs/long/steps?max_points=1000", 1.0, 400_000),
            ("/dashboard/api/runs/long/series", 1.0, 100_000),
            ("/dashboard/api/runs/long/state", 0.2, 1_000)):
        client.get(path, headers=OPERATOR)  # warm
        t = time.perf_counter()
        r = client.get(path, headers=OPERATOR)
        took = time.perf_counter() - t
        assert r.status_code == 200, (path, r.text[:200])
        print(f"{path}: {took * 1000:.0f} ms, {len(r.content)} bytes")
        assert took < limit_s, (path, took)
        assert len(r.content) < max_bytes, (path, len(r.content))
    points = client.get("/api/v1/runs/long/steps?max_points=1000", headers=OPERATOR).json()
    assert 900 <= len(points["points"]) <= 1000

"""Restart anatomy, checkpoint-interval advice and MFU/scaling on a
scripted run whose every answer is known, through the store reads and the API, on SQLite
and Postgres.

The history (seconds after the run's registration at T0; 4 ranks on 2 nodes, rank 3 slow:
data 0.3 / compute 0.35 / step 0.7 s against 0.02 / 0.2 / 0.25 s for the others; 8 samples
per rank and step):

* attempt 0 reports steps 0..29, step s ending at 5 + 2 s, checkpoints after steps 10 and
  20 (``save_s`` 1.5, t 25 and 45);
* rank 3 (node 1) crashes at 64; the evaluator sees the exit at 66 and decides a restart
  (decided = 66); node 0's workers, stopped by the restart command, exit at 67.5;
* the agents start torchrun at 68 and 68.5; the ranks' ``worker_started`` arrive up to 71;
  rank 0 restored the checkpoint at 73;
* attempt 1 reports steps 20..39, step s ending at 75 + 2 (s - 20) (the first at 75), with
  checkpoints after steps 20 and 30 (t 75 and 95); read at 120.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from tests.dashboard.synth import OPERATOR, SynthRun
from tests.dashboard.synth import efficiency_script as script
from tests.supervisor.sup_helpers import FakeClock
from trainwarden.supervisor.control.evaluator import Evaluator
from trainwarden.supervisor.goodput import interval as iv
from trainwarden.supervisor.goodput.anatomy import MILESTONES, PHASES
from trainwarden.supervisor.observability import efficiency
from trainwarden.supervisor.store import efficiency as eff
from trainwarden.supervisor.store import goodput as goodput_store
from trainwarden.supervisor.store.db import Database

MILESTONE_T = {"decided": 66.0, "workers_stopped": 67.5, "torchrun_started": 68.5,
               "rendezvous_done": 71.0, "preflight_done": 72.0,
               "checkpoint_loaded": 73.0, "first_step": 75.0}
PHASE_S = {"stop_workers": 1.5, "launch": 1.0, "rendezvous": 2.5, "preflight": 1.0,
           "load_checkpoint": 1.0,
           "first_step": 2.0}
END = 120.0


def _rel(times: dict[str, Any], t0: float) -> dict[str, Any]:
    return {k: None if v is None else pytest.approx(v - t0) for k, v in times.items()}


# --- the store reads ---------------------------------------------------------------------


def test_store_reads_every_milestone_of_the_restart(client: TestClient, clock: FakeClock,
                                                    evaluator: Evaluator, db: Database) -> None:
    t0 = clock.now
    script(client, clock, evaluator)
    with db.read() as conn:
        (times,) = eff.restart_milestones(conn, run_id=1).values()
        faults = eff.restart_faults(conn, run_id=1)
        assert eff.failure_count(conn, run_id=1) == 1
        assert eff.node_count(conn, run_id=1) == 2
        ckpts = eff.complete_checkpoints(conn, run_id=1)
        means = eff.rank_phase_means(conn, run_id=1, attempt=1, step_from=20, step_to=39)
    assert set(times) == set(MILESTONES)
    assert _rel(times, t0) == {k: pytest.approx(v) for k, v in MILESTONE_T.items()}
    assert [v - t0 for v in faults.values()] == [pytest.approx(64.0)]  # the crash's exit
    assert [(c["attempt"], c["t"] - t0) for c in ckpts] == [(0, 25), (0, 45), (1, 75), (1, 95)]
    assert [m[0] for m in means] == [0, 1, 2, 3]
    assert means[3][1:] == (pytest.approx(0.3), pytest.approx(0.35), pytest.approx(0.7))


def test_a_milestone_not_recorded_reads_as_none(client: TestClient, clock: FakeClock,
                                                evaluator: Evaluator, db: Database) -> None:
    """An older agent sends no torchrun_started and its workers none of the events: the
    supervisor's receipt of the agents' "done" stands in for the launch (none here: the
    synthetic agents send no command results), the rest is unknown."""
    script(client, clock, evaluator, milestones=False)
    with db.read() as conn:
        (times,) = eff.restart_milestones(conn, run_id=1).values()
    assert times["torchrun_started"] is None
    assert times["rendezvous_done"] is None
    assert times["preflight_done"] is None
    assert times["checkpoint_loaded"] is None
    assert times["first_step"] is not None


# --- the API -----------------------------------------------------------------------------


def test_restart_phases_on_the_actions_and_the_run(client: TestClient, clock: FakeClock,
                                                    evaluator: Evaluator) -> None:
    script(client, clock, evaluator)
    (act,) = client.get("/api/v1/runs/alpha/actions", headers=OPERATOR).json()["actions"]
    an = act["anatomy"]
    assert an["phases_s"] == {k: pytest.approx(v) for k, v in PHASE_S.items()}
    assert an["total_s"] == pytest.approx(9.0)
    assert an["notes"] == []
    one = client.get(f"/api/v1/actions/{act['id']}", headers=OPERATOR).json()
    assert one["anatomy"] == an
    run = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()
    assert run["last_restart"]["action_id"] == act["id"]
    assert run["last_restart"]["anatomy"] == an


def test_unknown_phases_are_null_not_zero(client: TestClient, clock: FakeClock,
                                          evaluator: Evaluator) -> None:
    script(client, clock, evaluator, milestones=False)
    (act,) = client.get("/api/v1/runs/alpha/actions", headers=OPERATOR).json()["actions"]
    phases = act["anatomy"]["phases_s"]
    assert phases["stop_workers"] == pytest.approx(1.5)
    assert [phases[p] for p in PHASES[1:]] == [None] * 5
    # the time is not lost: one span across the missing milestones
    assert act["anatomy"]["spans"][-1]["phase"] == (
        "launch+rendezvous+preflight+load_checkpoint+first_step")
    assert act["anatomy"]["spans"][-1]["seconds"] == pytest.approx(7.5)


def test_checkpoint_interval_advice_from_the_runs_own_figures(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    script(client, clock, evaluator)
    adv = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["checkpoint_interval"]
    inputs = adv["inputs"]
    assert inputs["nodes"] == 2
    assert inputs["failures"] == 1
    assert inputs["observed_s"] == pytest.approx(END)
    assert inputs["save_stall_s"] == pytest.approx(1.5)
    assert inputs["interval_s"] == pytest.approx(20.0)  # within each attempt
    assert inputs["restart_s"] == pytest.approx(75.0 - 64.0)  # the fault -> the first step
    assert adv["rate_source"] == "observed"
    assert adv["mtbf_s"] == pytest.approx(END)  # 1 failure in 120 s of the whole job
    want = iv.optimal_interval(mtbf_s=END, restart_s=11.0, save_stall_s=1.5)
    assert want is not None
    assert adv["recommended_s"] == pytest.approx(want)
    assert adv["current_s"] == pytest.approx(20.0)
    ettr = {dt: iv.expected_ettr(nodes=2, rate_per_node_s=1 / (2 * END), restart_s=11.0,
                                 interval_s=dt, save_stall_s=1.5) for dt in (20.0, want)}
    assert adv["ettr_current"] == pytest.approx(ettr[20.0])
    assert adv["ettr_recommended"] == pytest.approx(ettr[want])
    assert adv["state"] == "ok" and adv["missing"] == []


def test_checkpoint_interval_without_a_failure_says_not_enough_data(
        client: TestClient, clock: FakeClock) -> None:
    run = SynthRun(client, "calm").register()
    run.train(range(30), t0=clock.now + 5, dt=2.0, checkpoint_every=10)
    clock.now += 80
    adv = client.get("/api/v1/runs/calm", headers=OPERATOR).json()["checkpoint_interval"]
    assert adv["state"] == "not_enough_data"
    assert adv["recommended_s"] is None
    assert adv["rate_source"] == "none"
    assert adv["missing"][0].startswith("failures: none observed")
    assert adv["ettr_current"] == pytest.approx(1 / (1 + 1.5 / 20.0))  # the saves alone


def test_mfu_per_run_and_rank_with_band_shares_and_scaling(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    script(client, clock, evaluator)
    m = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["mfu"]
    # 32 samples every 2 s x 2e9 FLOPs / (4 ranks x 1e12 FLOP/s)
    assert m["mfu"] == pytest.approx(16 * 2e9 / 4e12)
    assert m["band"]["name"] == "host_bound"
    assert "CPU" in m["band"]["meaning"]
    ranks = {r["rank"]: r for r in m["ranks"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert ranks[0]["data"] == pytest.approx(0.02 / 0.25)
    assert ranks[0]["comm"] == pytest.approx(1 - 0.02 / 0.25 - 0.2 / 0.25)
    assert ranks[3]["data"] == pytest.approx(0.3 / 0.7)
    work = 32 / 4 * 2e9 / 1e12  # seconds at peak per rank and step
    assert ranks[0]["mfu"] == pytest.approx(work / 0.25)
    assert ranks[3]["mfu"] == pytest.approx(work / 0.7)
    assert m["data_share"] == pytest.approx(0.08)  # the median rank
    s = m["scaling"]
    assert s["efficiency"] == pytest.approx(16 / (4 * 8.0))
    assert [c["name"] for c in s["causes"]] == ["data_loader", "batch_per_device",
                                                "interconnect", "straggler"]
    assert [c["verdict"] for c in s["causes"]] == ["against", "against", "against", "for"]
    assert s["likely"] == "straggler"


def test_scaling_efficiency_is_null_without_a_declared_baseline(
        client: TestClient, clock: FakeClock, evaluator: Evaluator) -> None:
    script(client, clock, evaluator, baseline=None)
    m = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()["mfu"]
    assert m["scaling"]["efficiency"] is None
    assert m["scaling"]["likely"] == "straggler"  # the causes need no baseline


def test_the_api_and_the_pure_module_agree(client: TestClient, clock: FakeClock,
                                           evaluator: Evaluator, db: Database) -> None:
    script(client, clock, evaluator)
    api = client.get("/api/v1/runs/alpha", headers=OPERATOR).json()
    with db.read() as conn:
        from trainwarden.supervisor.store import registry
        run = registry.get_run_by_name(conn, name="alpha")
        assert run is not None
        assert efficiency.mfu_report(conn, run) == api["mfu"]


def test_save_cost_counts_asynchronous_and_instant_saves_as_no_stall(
        client: TestClient, clock: FakeClock, db: Database) -> None:
    """An asynchronous save stalls training for its staging only (not reported): 0; a save
    of 0 s is a save of no stall, not a missing one; a negative one is left out."""
    run = SynthRun(client, "saves").register()
    t0 = clock.now
    run.send(0, [{"type": "checkpoint", "attempt": 0, "rank": 0, "t": t0 + 10 * i, "step": i,
                  "path": f"/ckpt/saves/step-{i}", "bytes": 1, "lineage": "a0", **extra}
                 for i, extra in enumerate([{"save_s": 3.0}, {"save_s": 0.0},
                                            {"save_s": 9.0, "async_save": True},
                                            {"save_s": -1.0}], start=1)])
    clock.now = t0 + 60
    adv = client.get("/api/v1/runs/saves", headers=OPERATOR).json()["checkpoint_interval"]
    assert adv["inputs"]["save_stall_s"] == pytest.approx((3.0 + 0.0 + 0.0) / 3)
    assert adv["measured"]["saves_timed"] == 3
    assert adv["inputs"]["interval_s"] == pytest.approx(10.0)


def test_save_cost_is_the_stall_the_worker_measured(
        client: TestClient, clock: FakeClock, db: Database) -> None:
    """A save that says how long it blocked the loop (``stall_s``: an asynchronous save's
    staging) costs that in the interval advice, and the store keeps it for the goodput."""
    run = SynthRun(client, "staged").register()
    t0 = clock.now
    run.send(0, [{"type": "checkpoint", "attempt": 0, "rank": 0, "t": t0 + 10 * i, "step": i,
                  "path": f"/ckpt/staged/step-{i}", "bytes": 1, "lineage": "a0", **extra}
                 for i, extra in enumerate([
                     {"save_s": 9.0, "async_save": True, "stall_s": 0.4},
                     {"save_s": 3.0, "stall_s": 3.5}], start=1)])
    clock.now = t0 + 60
    adv = client.get("/api/v1/runs/staged", headers=OPERATOR).json()["checkpoint_interval"]
    assert adv["inputs"]["save_stall_s"] == pytest.approx((0.4 + 3.5) / 2)
    with db.read() as conn:
        rows = goodput_store.checkpoints_after(conn, run_id=1, after_id=0)
    assert [r["stall_s"] for r in rows] == [pytest.approx(0.4), pytest.approx(3.5)]


def test_a_second_restart_counts_the_exits_of_its_own_attempt_only(
        client: TestClient, clock: FakeClock, evaluator: Evaluator, db: Database) -> None:
    """Attempt 1 crashes too (its rank 3 at 130, decided at 132): the second restart's
    workers stopped at attempt 1's exit, the first's at attempt 0's."""
    t0 = clock.now
    run = script(client, clock, evaluator)
    run.crash(node=1, rank=3, t=t0 + 130, attempt=1)
    clock.now = t0 + 132
    evaluator.tick()
    with db.read() as conn:
        first, second = (eff.restart_milestones(conn, run_id=1)[i] for i in (1, 2))
    assert first["workers_stopped"] == pytest.approx(t0 + 67.5)
    assert second["workers_stopped"] == pytest.approx(t0 + 130)
    assert second["first_step"] is None  # attempt 2 has not started


def test_the_figures_a_shrink_or_wait_choice_reads(client: TestClient, clock: FakeClock,
                                                   evaluator: Evaluator, db: Database) -> None:
    script(client, clock, evaluator)
    with db.read() as conn:
        f = eff.elastic_figures(conn, run_id=1)
    assert f["restart_s"] == pytest.approx(75.0 - 66.0)  # decided -> first step
    assert f["interval_s"] == pytest.approx(20.0)  # checkpoints 20 s apart in an attempt
    assert f["step_s"] == pytest.approx(0.7)  # the slowest rank's step, the median step


def test_a_rolled_back_spike_is_a_failure_of_the_interval_advice(
        client: TestClient, clock: FakeClock, db: Database) -> None:
    """A spike the policy rolled back lost the work since the checkpoint as a crash does: the
    advice counts it (not "no failures observed"); a spike only watched is no failure."""
    from trainwarden.supervisor.control import actions, policy
    from trainwarden.supervisor.enums import IncidentKind
    from trainwarden.supervisor.store import registry

    run = SynthRun(client, "spiky").register()
    run.train(range(30), t0=clock.now + 5, dt=2.0, checkpoint_every=10)
    clock.now += 80
    with db.write() as conn:
        row = registry.get_run_by_name(conn, name="spiky")
        assert row is not None
        watched = policy.IncidentSpec(kind=IncidentKind.STRAGGLER, cause="slow", attempt=0)
        actions.apply(conn, run=row, decision=policy.OpenIncident(incident=watched),
                      now=clock.now)
        assert eff.failure_count(conn, run_id=int(row["id"])) == 0
        spike = policy.IncidentSpec(kind=IncidentKind.LOSS_SPIKE, cause="loss x10",
                                    attempt=0, step=25)
        actions.apply(conn, run=row, decision=policy.Restart(
            attempt=1, checkpoint=None, not_before=clock.now, reason="roll back",
            incident=spike, cause="spike", rollback_to_step=20), now=clock.now)
        assert eff.failure_count(conn, run_id=int(row["id"])) == 1
    adv = client.get("/api/v1/runs/spiky", headers=OPERATOR).json()["checkpoint_interval"]
    assert adv["inputs"]["failures"] == 1
    assert not any(m.startswith("failures: none observed") for m in adv["missing"]), adv

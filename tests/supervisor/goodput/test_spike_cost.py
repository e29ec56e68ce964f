"""The cost of a loss spike against a rollback's, on synthetic curves with the shape of real
training (a power law with noise)."""

from __future__ import annotations

import math
import random

import pytest

from trainwarden.agent.core.findings import FindingKind, Severity
from trainwarden.supervisor.control import policy
from trainwarden.supervisor.control.detection import (
    DetectionConfig,
    loss_findings,
    with_spike_cost,
)
from trainwarden.supervisor.goodput.spike_cost import SpikeCostConfig, progress_lost, spike_cost
from trainwarden.supervisor.store.rows import LossRow


def curve(n: int, *, seed: int = 0, floor: float = 0.5, noise: float = 0.03,
          excess: dict[int, float] | None = None) -> list[tuple[int, float]]:
    """``floor + 3.5 / sqrt(step + 1)`` with multiplicative noise; ``excess``: step -> factor."""
    rng = random.Random(seed)
    out = []
    for s in range(n):
        x = (floor + 3.5 / math.sqrt(s + 1)) * (1 + noise * rng.gauss(0, 1))
        out.append((s, x * (excess or {}).get(s, 1.0)))
    return out


def test_a_clean_curve_lost_nothing() -> None:
    h = curve(400)
    c = spike_cost(h, start=300, step_s=1.0, checkpoint_step=250, restart_s=30.0)
    assert c is not None
    assert c.lost_steps == 0 and c.lost_s == 0 and c.excess == 0
    assert c.cheaper == "wait" and not c.above_early


def test_a_late_small_excess_that_lasts_is_many_steps_and_rolled_back_when_cheaper() -> None:
    """10% more loss late in the run is the level of well over a hundred steps earlier."""
    h = curve(900, excess={s: 1.1 for s in range(800, 900)})
    c = spike_cost(h, start=800, step_s=1.0, checkpoint_step=790, skipped_batches=15,
                   restart_s=10.0, end_step=1000)
    assert c is not None
    assert c.excess == pytest.approx(0.1, abs=0.04)
    assert c.lost_steps > 100  # although the excess is small
    assert c.lost_steps_at_end is not None and c.lost_steps_at_end >= c.lost_steps
    assert c.lost_s == c.lost_steps * 1.0
    # 109 steps trained again + 15 skipped + a 10 s restart: cheaper than what it lost
    assert c.rollback_steps == pytest.approx(109 + 15 + 10)
    assert c.rollback_s == pytest.approx(c.rollback_steps * 1.0)
    assert c.cheaper == "rollback" and c.restart_measured
    # The same excess with a restart that costs more than the progress lost: wait.
    dear = spike_cost(h, start=800, step_s=1.0, checkpoint_step=790, skipped_batches=15,
                      restart_s=600.0, end_step=1000)
    assert dear is not None and dear.cheaper == "wait"


def test_an_early_large_excess_that_comes_back_costs_while_high_then_nothing() -> None:
    bump = {s: 3.0 for s in range(100, 115)}
    h = curve(200, excess=bump)
    during = spike_cost(h[:112], start=100, step_s=1.0, checkpoint_step=50, restart_s=30.0)
    assert during is not None and during.lost_steps > 50 and not during.above_early
    after = spike_cost(h, start=100, step_s=1.0, checkpoint_step=50, restart_s=30.0,
                       end_step=1000)
    assert after is not None
    assert after.lost_steps == 0 and after.lost_steps_at_end == 0 and after.cheaper == "wait"


def test_a_one_step_blip_costs_nothing_and_is_never_rolled_back() -> None:
    h = curve(320, excess={300: 10.0})
    for now in (300, 301, 305, 319):
        c = spike_cost(h[:now + 1], start=300, step_s=1.0, checkpoint_step=290,
                       restart_s=0.0, end_step=10_000)
        assert c is not None
        assert (c.lost_steps, c.lost_s, c.lost_steps_at_end) == (0, 0.0, 0), now
        assert c.cheaper == "wait", now


def test_a_jump_above_the_early_training_loss_erased_everything_and_is_rolled_back_at_once(
) -> None:
    """10x the loss at step 500 is above the untrained model's: everything since is gone."""
    h = curve(505, excess={s: 10.0 for s in range(500, 505)})
    c = spike_cost(h, start=500, step_s=1.0, checkpoint_step=450, skipped_batches=20,
                   restart_s=60.0)
    assert c is not None
    assert c.above_early and c.equivalent_step == 0 and c.lost_steps == 504
    assert c.cheaper == "rollback" and c.certain
    # Whatever the restart costs: nothing is left to lose, nothing says it comes back.
    dear = spike_cost(h, start=500, step_s=0.01, checkpoint_step=450, restart_s=600.0)
    assert dear is not None and dear.rollback_steps > dear.lost_steps
    assert dear.cheaper == "rollback" and dear.certain
    # Its statement says the rule decided, never that the dearer rollback is cheaper.
    assert "is cheaper" not in dear.summary()
    assert "early-training loss" in dear.summary() and "rolling back" in dear.summary()


def test_no_checkpoint_no_rollback_and_a_default_restart_when_none_was_measured() -> None:
    h = curve(505, excess={s: 10.0 for s in range(500, 505)})
    c = spike_cost(h, start=500, step_s=1.0, checkpoint_step=None)
    assert c is not None and c.rollback_steps == math.inf and c.cheaper == "wait"
    d = spike_cost(h, start=500, step_s=0.5, checkpoint_step=450)
    assert d is not None and not d.restart_measured
    assert d.restart_s == SpikeCostConfig().default_restart_s
    assert d.rollback_steps == pytest.approx(54 + d.restart_s / 0.5)
    assert d.certain and "rolling back whatever it costs" in d.summary()


def test_too_little_history_is_no_figure() -> None:
    assert spike_cost(curve(5), start=3, step_s=1.0, checkpoint_step=0) is None
    assert spike_cost(curve(50), start=60, step_s=1.0, checkpoint_step=0) is None


def _finding(kind: str, severity: Severity, h: list[tuple[int, float]], start: int,
             restart_s: float | None, **extra: object) -> policy.FindingFacts:
    p = progress_lost(h, start=start, step_s=0.5)
    assert p is not None
    return policy.FindingFacts(kind=kind, severity=severity, message="spike", attempt=0,
                               step=start, details={"progress_lost": p.as_details(),
                                                    "restart_s": restart_s, **extra})


def _decide(f: policy.FindingFacts, rec: policy.RecoveryFacts) -> policy.Decision:
    return policy.on_finding(policy.RunFacts(id=1, name="r", status="running", attempt=0,
                                             restarts=0), f,
                             incident_kinds_this_attempt=frozenset(), open_watch=frozenset(),
                             checkpoint=None, cfg=policy.PolicyConfig(), now=0.0,
                             recovery=rec)


def test_a_transient_spike_is_recorded_with_both_figures_and_which_was_cheaper() -> None:
    h = curve(900, excess={s: 1.1 for s in range(800, 900)})
    rec = policy.RecoveryFacts(checkpoints=((750, "/ck/750"), (790, "/ck/790")))
    d = _decide(_finding(FindingKind.LOSS_SPIKE_TRANSIENT, Severity.EVENT, h, 800, 5.0), rec)
    assert isinstance(d, policy.RecordEvent)
    cost = d.details["spike_cost"]
    # The checkpoint a rollback would load (10 steps before the spike at least), the skip it
    # would make (10 batches before the spike through now), the measured restart.
    assert cost["checkpoint_step"] == 790 and cost["skipped_batches"] == 899 - 790 + 1
    assert cost["rollback_steps"] == pytest.approx(109 + 110 + 5.0 / 0.5)
    assert cost["lost_steps"] > 100 and cost["restart_measured"]
    assert f"progress lost {cost['lost_steps']} steps" in d.message
    assert cost["cheaper"] in d.message.replace("rolling back", "rollback").replace(
        "waiting", "wait")


def test_a_spike_incident_states_both_figures_without_a_measured_restart() -> None:
    h = curve(505, excess={s: 10.0 for s in range(500, 505)})
    rec = policy.RecoveryFacts(checkpoints=((450, "/ck/450"),))
    d = _decide(_finding(FindingKind.LOSS_SPIKE, Severity.INCIDENT, h, 500, None,
                         detected_at_step=504), rec)
    assert isinstance(d, policy.Restart) and d.incident is not None
    cost = d.incident.details["spike_cost"]
    assert cost["above_early"] and cost["cheaper"] == "rollback" and cost["certain"]
    assert not cost["restart_measured"] and "restart time not measured yet" in d.incident.cause


def test_the_observer_puts_what_a_spike_cost_on_its_finding() -> None:
    """The loss window's spike findings carry the progress lost (measured over the window,
    with the step time measured on it) and the run's measured restart time."""
    h = curve(300, excess={s: 3.0 for s in range(200, 215)})
    rows: list[LossRow] = [
        {"attempt": 0, "step": s, "loss": x, "loss_sum": 2 * x, "loss_count": 2,
         "loss_nonfinite": 0, "grad_norm_nonfinite": 0, "samples": 64, "tokens": 0,
         "t_first": 1000.0 + 0.25 * s, "t_last": 1000.0 + 0.25 * s} for s, x in h]
    cfg = DetectionConfig()
    found = with_spike_cost(loss_findings(rows, cfg=cfg), rows, lambda: 12.5)
    (f,) = [f for f in found if f.kind == FindingKind.LOSS_SPIKE_TRANSIENT]
    p = f.details["progress_lost"]
    assert p["start_step"] == 200 and p["step_s"] == pytest.approx(0.25)
    assert p["now_step"] == 299 and p["lost_steps"] == 0  # back, nothing lasting
    assert f.details["restart_s"] == 12.5
    # Other findings are left as they are.
    assert with_spike_cost([], rows, lambda: 1 / 0) == []

"""The simulated long run: the ETTR accumulator on a Poisson failure schedule agrees with
Meta's expected-ETTR model, and each fault kind lands in its part; a node that died for good
restarts the gang once a spare, a repaired node or one from outside takes its rank, or
at once on the nodes left (down to ``min_nodes``), growing back at a checkpoint once a node
comes."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest

from trainwarden.supervisor.goodput.ettr import (
    CheckpointSaved,
    Event,
    Incident,
    RestartDecided,
    Resumed,
    StepDone,
)
from trainwarden.supervisor.goodput.interval import expected_ettr
from trainwarden.supervisor.goodput.simulate import (
    LLAMA3_HARDWARE_SHARE,
    FaultKind,
    SimConfig,
    events,
    simulate,
    with_node_losses,
)

CRASH = FaultKind("crash", 1.0, detect_s=1.0, restart_s=9.0)


def test_agrees_with_meta_s_model() -> None:
    cfg = SimConfig(mtbf_s=3600.0, days=10, step_s=10.0, interval_s=600.0, stall_s=2.0,
                    kinds=(CRASH,), seed=3)
    r = simulate(cfg)
    model = expected_ettr(nodes=1, rate_per_node_s=1 / 3600, restart_s=10.0,
                          interval_s=600.0, save_stall_s=2.0)
    assert r.faults["crash"] == pytest.approx(10 * 24, rel=0.15)  # Poisson, ~240
    assert r.breakdown.ettr == pytest.approx(model, abs=0.01)
    b = r.breakdown
    # 1 s of detection and 9 s of restart per fault, exactly
    assert b.detection == pytest.approx(r.faults["crash"] * 1.0)
    assert b.restart == pytest.approx(r.faults["crash"] * 9.0)
    assert sum(b.parts().values()) == pytest.approx(b.wall_s)


def test_no_faults_costs_only_the_saves() -> None:
    cfg = SimConfig(mtbf_s=math.inf, days=0.25, step_s=1.0, interval_s=100.0, stall_s=1.0,
                    kinds=(CRASH,))
    b = simulate(cfg).breakdown
    assert b.ettr == pytest.approx(100 / 101, abs=1e-4)
    assert b.lost == 0.0


def test_a_spike_trains_until_detected_and_rolls_back_before_it() -> None:
    spike = FaultKind("loss_spike", 1.0, detect_s=30.0, restart_s=5.0,
                      trains_until_detected=True)
    cfg = SimConfig(mtbf_s=2000.0, days=0.4, step_s=1.0, interval_s=100.0, stall_s=0.0,
                    kinds=(spike,), seed=5)
    r = simulate(cfg)
    b = r.breakdown
    # the detection time (steps trained from the spike to its incident) is detection once the
    # rollback throws those steps away
    assert b.detection == pytest.approx(r.faults["loss_spike"] * 30.0)
    # the old workers' step in flight at the detection overlaps the restart: step time wins
    assert r.faults["loss_spike"] * 4.0 <= b.restart <= r.faults["loss_spike"] * 5.0
    assert b.lost >= r.faults["loss_spike"] * 1.0  # at least the step in flight at each
    resumed = [e for e in events(cfg) if type(e).__name__ == "Resumed"]
    assert all(e.step % 100 == 0 for e in resumed)  # always a checkpoint's step


def test_deterministic_for_a_seed() -> None:
    cfg = SimConfig(mtbf_s=1800.0, days=0.25, step_s=2.0, interval_s=120.0, stall_s=1.0,
                    kinds=(CRASH,), seed=9)
    assert simulate(cfg).breakdown == simulate(cfg).breakdown


def test_shares_must_add_up() -> None:
    with pytest.raises(ValueError, match=r"^SimConfig\.kinds must be fault kinds whose shares "
                                         r"add up to 1 \(got 0\.5\)"):
        SimConfig(mtbf_s=1.0, days=1, step_s=1.0, interval_s=1.0, stall_s=0.0,
                  kinds=(FaultKind("crash", 0.5, 1.0, 1.0),))


def test_an_asynchronous_save_costs_its_staging_and_is_usable_once_written() -> None:
    """Staging 0.5 s, written 30 s later: with no faults only the staging is checkpoint time
    (accounted when the save completes); a fault inside the write restores the save before."""
    clean = SimConfig(mtbf_s=math.inf, days=0.25, step_s=1.0, interval_s=100.0, stall_s=0.5,
                      write_s=30.0, kinds=(CRASH,))
    b = simulate(clean).breakdown
    saves = [e for e in events(clean) if isinstance(e, CheckpointSaved)]
    assert b.checkpoint == pytest.approx(len(saves) * 0.5)
    assert b.other == pytest.approx(0.0, abs=1e-6)
    assert all(e.released_at == pytest.approx(e.t - 30.0) for e in saves)
    faulty = dataclasses.replace(clean, mtbf_s=900.0, seed=4)
    evs = events(faulty)
    done: list[CheckpointSaved] = []
    restores = 0
    for e in evs:
        if isinstance(e, CheckpointSaved):
            done.append(e)
        elif isinstance(e, Incident):
            fault = e.t_fault or e.t_detected
            target = max((s.step for s in done if s.t <= fault), default=0)
            resumed = next(x for x in evs if isinstance(x, Resumed) and x.t >= e.t_detected)
            assert resumed.step == target
            restores += 1
    assert restores > 5


def test_a_save_due_while_the_last_is_still_written_waits_for_it() -> None:
    cfg = SimConfig(mtbf_s=math.inf, days=0.05, step_s=1.0, interval_s=10.0, stall_s=0.5,
                    write_s=25.0, kinds=(CRASH,))
    saves = [e for e in events(cfg) if isinstance(e, CheckpointSaved)]
    assert len(saves) > 10
    # after the first, each save waits out the rest of the previous write (its stall: the
    # wait and the staging), so they come at one steady pace, not every 10 s
    gaps = [b.t - a.t for a, b in itertools.pairwise(saves)]
    assert gaps[1:] == [pytest.approx(gaps[1])] * len(gaps[1:])
    assert all(s.stall_s > 0.5 for s in saves[1:])
    assert simulate(cfg).breakdown.checkpoint == pytest.approx(sum(s.stall_s for s in saves))


# --------------------------------------------------------------------------------------------
# Nodes that die for good

NODE = FaultKind("node_lost", 1.0, detect_s=30.0, restart_s=10.0, needs_node=True)
HOUR = 3600.0


def node_run(**kw: object) -> SimConfig:
    """Only node losses, one every 2 h of training on average, over 5 days."""
    base: dict[str, object] = dict(mtbf_s=2 * HOUR, days=5, step_s=10.0, interval_s=300.0,
                                   stall_s=1.0, kinds=(NODE,), seed=11)
    return SimConfig(**{**base, **kw})  # type: ignore[arg-type]


def losses(evs: list[Event]) -> list[tuple[float, float]]:
    """(detected, the new attempt's first step begins) per node loss, in order."""
    incidents = [e.t_detected for e in evs if isinstance(e, Incident)]
    resumed = [e.t for e in evs if isinstance(e, Resumed)]
    assert len(incidents) == len(resumed)
    return list(zip(incidents, resumed, strict=True))


def test_with_no_spare_a_node_loss_waits_for_the_node_from_outside() -> None:
    cfg = node_run(spares=0, replace_s=4 * HOUR, repair_s=HOUR)
    r = simulate(cfg)
    pairs = losses(events(cfg))
    assert len(pairs) >= 5
    assert [b - a for a, b in pairs] == [pytest.approx(4 * HOUR + 10.0)] * len(pairs)
    n = r.nodes
    assert n.losses == n.waits == n.from_outside == len(pairs) == r.faults["node_lost"]
    assert n.fewest_free == 0
    horizon = cfg.days * 86_400
    assert n.wait_s == pytest.approx(sum(min(a + 4 * HOUR, horizon) - a for a, _ in pairs))
    # the wait is restart time: the 10 s restarts and the waits, up to the end of the run
    assert r.breakdown.restart == pytest.approx(sum(min(b, horizon) - a for a, b in pairs))


def test_with_enough_spares_no_loss_waits_and_the_run_is_one_with_a_node_always_at_hand(
        ) -> None:
    spared = node_run(spares=1000, replace_s=4 * HOUR, repair_s=30 * 86_400.0)
    r = simulate(spared)
    pairs = losses(events(spared))
    assert [b - a for a, b in pairs] == [pytest.approx(10.0)] * len(pairs)
    assert r.nodes.waits == 0 and r.nodes.wait_s == 0.0 and r.nodes.from_outside == 0
    assert r.nodes.fewest_free == 1000 - len(pairs)  # none back from a 30-day repair
    at_hand = node_run()  # no spares, a node from outside at once
    assert events(at_hand) == events(spared)
    assert simulate(at_hand).breakdown == r.breakdown
    # and a kind that needs no node ignores the pool
    plain = node_run(kinds=(dataclasses.replace(NODE, needs_node=False),), spares=0,
                     replace_s=4 * HOUR)
    assert simulate(plain).breakdown == r.breakdown
    assert simulate(plain).nodes.losses == 0


def test_the_spare_pool_runs_dry() -> None:
    """Three spares that never come back: the first three losses restart at once, every one
    after waits the node from outside."""
    cfg = node_run(spares=3, replace_s=HOUR, repair_s=math.inf)
    r = simulate(cfg)
    pairs = losses(events(cfg))
    assert len(pairs) > 6
    waits = [b - a - 10.0 for a, b in pairs]
    assert waits == [pytest.approx(0.0, abs=1e-6)] * 3 + [pytest.approx(HOUR)] * (len(pairs) - 3)
    assert r.nodes.waits == r.nodes.from_outside == len(pairs) - 3
    assert r.nodes.fewest_free == 0


def test_a_repaired_node_rejoins_the_spares() -> None:
    """One spare, a 3 h repair, no node from outside within the run: the spare and the dead
    nodes take turns, so each loss restarts once the node before it is repaired (at once
    when it already is)."""
    repair = 3 * HOUR
    cfg = node_run(spares=1, replace_s=100 * 86_400.0, repair_s=repair)
    r = simulate(cfg)
    pairs = losses(events(cfg))
    ready = [b - 10.0 for _, b in pairs]
    assert ready[0] == pytest.approx(pairs[0][0])
    for (prev, _), (det, _), at in zip(pairs, pairs[1:], ready[1:], strict=False):
        assert at == pytest.approx(max(det, prev + repair))
    assert 0 < r.nodes.waits < len(pairs)  # some found it repaired, some waited for it
    assert r.nodes.from_outside == 0 and r.nodes.fewest_free == 0


def test_whichever_comes_first_a_repaired_node_or_one_from_outside() -> None:
    """One spare, a 3 h repair, a node from outside in 1 h: no loss waits longer than the
    hour, and each wait ends with the node from outside or with a dead node repaired."""
    cfg = node_run(spares=1, replace_s=HOUR, repair_s=3 * HOUR, days=20)
    r = simulate(cfg)
    pairs = losses(events(cfg))
    repaired = {round(a + 3 * HOUR, 6) for a, _ in pairs}
    kinds = set()
    for det, resumed in pairs:
        at = resumed - 10.0
        assert det - 1e-6 <= at <= det + HOUR + 1e-6
        if at > det + 1e-6:
            outside = at == pytest.approx(det + HOUR)
            assert outside or round(at, 6) in repaired
            kinds.add("outside" if outside else "repaired")
    assert kinds == {"outside", "repaired"}
    assert 0 < r.nodes.from_outside < r.nodes.waits


def test_more_spares_never_cost_more() -> None:
    """The same faults (one seed) with 0, 1, 2 and plenty of spares: each loss waits no
    longer with more spares, so ETTR rises (to within the work one checkpoint interval
    holds, where the run ends), and with plenty it is the run with a node always at hand."""
    kinds = with_node_losses((CRASH,), detect_s=30.0, restart_s=10.0)
    for seed in (1, 2, 3):
        runs = [simulate(node_run(kinds=kinds, seed=seed, spares=n, replace_s=4 * HOUR,
                                  repair_s=12 * HOUR)) for n in (0, 1, 2, 50)]
        ettr = [x.breakdown.ettr or 0.0 for x in runs]
        slack = 300.0 / runs[0].breakdown.wall_s
        assert all(b >= a - slack for a, b in itertools.pairwise(ettr)), ettr
        assert ettr[0] < ettr[-1] - 0.1, ettr  # a 4 h wait for most losses is felt
        waited = [x.nodes.wait_s for x in runs]
        assert waited[0] > waited[-1] == 0.0
        at_hand = simulate(node_run(kinds=kinds, seed=seed))
        assert runs[-1].breakdown == at_hand.breakdown


def test_node_losses_take_their_share_of_the_faults() -> None:
    hang = FaultKind("hang", 0.25, 40.0, 9.0)
    kinds = with_node_losses((dataclasses.replace(CRASH, share=0.75), hang), detect_s=30.0,
                             restart_s=12.0)
    assert LLAMA3_HARDWARE_SHARE == 0.78
    assert [(k.name, k.share, k.needs_node) for k in kinds] == [
        ("crash", pytest.approx(0.75 * 0.22), False), ("hang", pytest.approx(0.25 * 0.22), False),
        ("node_lost", 0.78, True)]
    assert (kinds[-1].detect_s, kinds[-1].restart_s) == (30.0, 12.0)
    r = simulate(SimConfig(mtbf_s=600.0, days=5, step_s=5.0, interval_s=120.0, stall_s=0.0,
                           kinds=kinds, seed=2))
    assert r.faults["node_lost"] / sum(r.faults.values()) == pytest.approx(0.78, abs=0.03)
    assert r.nodes.losses == r.faults["node_lost"]
    with pytest.raises(ValueError, match=r"share must be in \[0, 1\] \(got 1\.5\)"):
        with_node_losses((CRASH,), detect_s=1.0, restart_s=1.0, share=1.5)


def test_the_node_settings_are_bounded() -> None:
    with pytest.raises(ValueError, match=r"^SimConfig\.spares must be an integer >= 0 "
                                         r"\(got -1\)"):
        node_run(spares=-1)
    with pytest.raises(ValueError, match=r"^SimConfig\.replace_s must be >= 0"):
        node_run(replace_s=-1.0)


# --------------------------------------------------------------------------------------------
# Shrinking to the nodes left


def shrink_run(**kw: object) -> SimConfig:
    """``node_run`` on 16 nodes, a node from outside 10 min after each loss, no spares,
    asynchronous saves written in 3 s."""
    base: dict[str, object] = dict(nodes=16, replace_s=600.0, write_s=3.0)
    return node_run(**{**base, **kw})


def test_without_min_nodes_or_at_the_full_world_the_run_waits_as_before() -> None:
    waits = shrink_run()
    for same in (shrink_run(min_nodes=16), shrink_run(min_nodes=16, replica_nodes=4),
                 shrink_run(nodes=1)):
        assert not same.shrinks
        assert events(same) == events(waits)
        assert simulate(same).breakdown == simulate(waits).breakdown
    r = simulate(waits)
    assert r.breakdown.capacity == 0.0
    assert (r.nodes.shrinks, r.nodes.grows, r.nodes.shrunk_s, r.nodes.fewest_nodes) == (
        0, 0, 0.0, None)


def test_a_loss_with_no_spare_restarts_at_once_on_the_nodes_left_and_grows_back() -> None:
    """Each loss restarts 10 s after its detection on 15 of 16 nodes (steps 16/15 as long,
    the extra their capacity); the run grows back at the first checkpoint after the node
    from outside arrived, a planned restart from that checkpoint once it is written."""
    cfg = shrink_run(min_nodes=12)
    evs = events(cfg)
    r = simulate(cfg)
    b, n = r.breakdown, r.nodes
    pairs = losses([e for e in evs if not isinstance(e, Resumed) or _after_incident(evs, e)])
    assert [s - d for d, s in pairs] == [pytest.approx(10.0)] * len(pairs)
    assert n.losses == n.shrinks == len(pairs) >= 20 and n.waits == 0 and n.wait_s == 0.0
    assert 0 < n.grows <= n.shrinks and n.fewest_nodes is not None and n.fewest_nodes <= 15
    shrunk = [e for e in evs if isinstance(e, StepDone) and e.capacity_s > 0]
    assert shrunk and all(e.step_s == pytest.approx(10.0 * 16 / 15) for e in shrunk
                          if e.capacity_s == pytest.approx(10.0 / 15))
    assert n.shrunk_s == pytest.approx(sum(e.step_s or 0.0 for e in shrunk))
    # each grow back: decided at a save's release, resumed once written (3 s) and restarted
    grows = [(d, next(x for x in evs if isinstance(x, Resumed) and x.attempt == d.attempt))
             for d in evs if isinstance(d, RestartDecided) and not _incident_at(evs, d.t)]
    assert len(grows) == n.grows
    for decided, resumed in grows:
        assert resumed.t - decided.t == pytest.approx(3.0 + 10.0)
        assert resumed.step == decided.resume_step
    assert n.grow_s == pytest.approx(13.0 * n.grows)
    # capacity as the accumulator reads it: the shrunk steps on the lineage, beyond 10 s each
    assert 0 < b.capacity <= sum(e.capacity_s for e in shrunk) + 1e-6
    assert sum(b.parts().values()) == pytest.approx(b.wall_s)
    assert b.ettr is not None and b.ettr > (simulate(shrink_run()).breakdown.ettr or 0.0)
    assert simulate(cfg) == r  # deterministic for a seed


def _incident_at(evs: list[Event], t: float) -> bool:
    return any(isinstance(e, Incident) and e.t_detected == t for e in evs)


def _after_incident(evs: list[Event], resumed: Resumed) -> bool:
    """A resume that follows an incident's restart (not a grow back)."""
    decided = next(e for e in evs if isinstance(e, RestartDecided)
                   and e.attempt == resumed.attempt)
    return _incident_at(evs, decided.t)


def test_below_min_nodes_the_run_waits_for_the_first_node_back() -> None:
    """min_nodes 15 of 16: one loss shrinks; a second one while shrunk waits for the first
    replacement to arrive (back to 15), not for its own."""
    cfg = shrink_run(min_nodes=15, replace_s=6 * HOUR, mtbf_s=HOUR, days=3)
    r = simulate(cfg)
    assert 0 < r.nodes.waits < r.nodes.losses and r.nodes.shrinks > 0
    assert r.nodes.fewest_nodes == 15
    assert r.nodes.waits + r.nodes.shrinks == r.nodes.losses
    assert r.nodes.wait_s < r.nodes.waits * 6 * HOUR  # the node before it came sooner


def test_a_replica_leaves_with_its_node_and_steps_slow_with_the_efficiency() -> None:
    cfg = shrink_run(min_nodes=8, replica_nodes=4, shrink_efficiency=0.8)
    steps = {round(e.step_s or 0.0, 9) for e in events(cfg) if isinstance(e, StepDone)}
    # 12 of 16 nodes at 80%: 10 x 16 / 12 / 0.8; 8 of 16 if two losses overlap
    assert round(10.0 * 16 / 12 / 0.8, 9) in steps
    assert steps <= {10.0, round(10.0 * 16 / 12 / 0.8, 9), round(10.0 * 16 / 8 / 0.8, 9)}
    assert simulate(cfg).nodes.fewest_nodes in (8, 12)


def test_the_shrink_settings_are_bounded() -> None:
    with pytest.raises(ValueError, match=r"^SimConfig\.min_nodes must be <= nodes \(16\) "
                                         r"\(got 17\); set nodes to the full world"):
        shrink_run(min_nodes=17)
    with pytest.raises(ValueError, match=r"^SimConfig\.min_nodes must be an integer >= 1 "
                                         r"\(got 0\); leave it unset not to shrink"):
        shrink_run(min_nodes=0)
    with pytest.raises(ValueError, match=r"^SimConfig\.replica_nodes must be a divisor of "
                                         r"nodes \(16\) \(got 3\)"):
        shrink_run(replica_nodes=3)
    with pytest.raises(ValueError, match=r"^SimConfig\.shrink_efficiency must be in \(0, 1\]"):
        shrink_run(shrink_efficiency=1.5)
    with pytest.raises(ValueError, match=r"^SimConfig\.nodes must be an integer >= 1"):
        shrink_run(nodes=0)

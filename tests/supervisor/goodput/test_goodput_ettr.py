"""ETTR accounting: every part of a scripted run checked against its hand-computed value."""

from __future__ import annotations

import random

import pytest

from trainwarden.supervisor.goodput.ettr import (
    PARTS,
    AgentsDown,
    AgentsUp,
    Breakdown,
    CheckpointSaved,
    EttrAccumulator,
    EttrConfig,
    Event,
    Incident,
    RankTiming,
    Requeued,
    RestartDecided,
    Resumed,
    RunEnded,
    StepDone,
    event_time,
    gang_step,
    save_stall_s,
    window,
)

DATA = 0.25  # every rank waits this long for its batch, every step


def ranks(slow: bool = False) -> list[RankTiming]:
    """Three ranks; ``slow``: rank 2 computes 0.25 s longer (pre-collective 1.0 vs 0.75)."""
    return [RankTiming(0, DATA, 0.5, 1.0), RankTiming(1, DATA, 0.5, 1.0),
            RankTiming(2, DATA, 0.75 if slow else 0.5, 1.0)]


def steps(attempt: int, first: int, n: int, t_begin: float,
          slow: range = range(0)) -> list[Event]:
    """``n`` back-to-back 1 s steps from ``t_begin``."""
    return [gang_step(attempt, s, t_begin + (s - first) + 1.0, ranks(s in slow))
            for s in range(first, first + n)]


def scripted_run() -> list[Event]:
    """Startup 10 s; a crash, a hang with the agents gone for 10 s, a loss-spike rollback,
    three checkpoint stalls, a straggler, an evaluation gap and a final gap.  See the
    expected values in ``test_scripted_run_every_part``."""
    ev: list[Event] = []
    ev += steps(0, 0, 10, 10.0)                           # steps 0-9 in [10, 20]
    ev += [CheckpointSaved(22.0, 10, stall_s=2.0)]        # save stalls [20, 22]
    ev += steps(0, 10, 5, 22.5)                           # 0.5 s evaluation, steps 10-14
    ev += [Incident(29.0, "crash", t_fault=28.0),         # in flight [27.5, 28], detect 1 s
           RestartDecided(29.0, 1),
           Resumed(34.0, 1, 10)]                          # steps 10-14 lost
    ev += steps(1, 10, 10, 35.0)                          # restart [29, 35]; steps in [35, 45]
    ev += [CheckpointSaved(46.0, 20, stall_s=1.0)]
    ev += steps(1, 20, 3, 46.0)                           # steps 20-22 in [46, 49]
    ev += [Incident(74.0, "hang", t_fault=49.0),          # hang detected after 25 s
           RestartDecided(74.0, 2),
           AgentsDown(76.0), AgentsUp(86.0),              # idle 10 s inside the restart
           Resumed(90.0, 2, 20)]                          # steps 20-22 lost
    ev += steps(2, 20, 10, 91.0)                          # restart [74,76]+[86,91]
    ev += [CheckpointSaved(102.0, 30, stall_s=1.0)]
    ev += steps(2, 30, 8, 102.0)                          # steps 30-37 in [102, 110]
    ev += [Incident(110.5, "loss_spike", t_fault=108.0),  # spike from step 35 (ended 108)
           RestartDecided(110.5, 3)]
    ev += steps(2, 38, 1, 110.0)                          # old workers' step 38, late
    ev += [Resumed(118.0, 3, 30)]                         # rollback: steps 30-35 lost,
    #                                                       36-37 trained undetected
    ev += steps(3, 30, 20, 120.0, slow=range(40, 45))     # restart [111, 120]; steps 30-49
    ev += [RunEnded(142.0)]                               # 2 s after the last step
    return ev


def feed_all(events: list[Event], start: float = 0.0,
             config: EttrConfig | None = None) -> EttrAccumulator:
    acc = EttrAccumulator(start=start, config=config or EttrConfig())
    for e in sorted(events, key=event_time):  # the integration's order
        acc.feed(e)
    return acc


def assert_adds_up(b: Breakdown) -> None:
    assert sum(b.parts().values()) == pytest.approx(b.wall_s, abs=1e-9)
    assert all(v >= -1e-12 for v in b.parts().values()), b.parts()


def test_gang_step_takes_median_data_and_straggler_beyond_the_median() -> None:
    s = gang_step(0, 7, 100.0, ranks(slow=True))
    assert s.step_s == 1.0
    assert s.data_s == DATA
    assert s.straggler_s == pytest.approx(0.25)  # max 1.0 - median 0.75


def test_gang_step_without_compute_times_has_no_straggler_and_caps_at_the_step() -> None:
    s = gang_step(0, 1, 5.0, [RankTiming(0, 2.0, None, 1.5), RankTiming(1, 3.0, None, None)])
    assert s.straggler_s == 0.0
    assert s.step_s == 1.5
    assert s.data_s == 1.5  # median 2.5, capped at the step


def test_scripted_run_every_part() -> None:
    b = feed_all(scripted_run()).snapshot(now=500.0)
    assert b.end == 142.0  # the run ended: wall time stops there
    assert b.wall_s == 142.0
    assert b.startup == pytest.approx(10.0)
    assert b.checkpoint == pytest.approx(2.0 + 1.0 + 1.0)
    assert b.other == pytest.approx(0.5 + 2.0)  # evaluation gap, after the last step
    # in flight at the crash 0.5, steps 10-14 5, steps 20-22 3, late step 38 1, steps 30-35 6
    assert b.lost == pytest.approx(0.5 + 5 + 3 + 1 + 6)
    # the crash's, the hang's, and the spike's: steps 36-37, trained after the spike's first
    # step until the incident, thrown away by the rollback
    assert b.detection == pytest.approx(1.0 + 25.0 + 2.0)
    assert b.idle == pytest.approx(10.0)
    assert b.restart == pytest.approx(6.0 + (2.0 + 5.0) + 9.0)
    # 50 lineage steps of 1 s: data 0.25 each, rank 2 0.25 s behind on steps 40-44
    assert b.data_wait == pytest.approx(50 * DATA)
    assert b.straggler == pytest.approx(5 * 0.25)
    assert b.productive == pytest.approx(50 - 50 * DATA - 5 * 0.25)
    assert b.steps_final == 50
    assert b.steps_lost == 5 + 3 + 1 + 8
    assert b.ettr == pytest.approx((50 - 12.5 - 1.25) / 142)
    assert_adds_up(b)


def test_snapshot_during_an_undetected_hang_reads_other_then_detection() -> None:
    ev = [e for e in scripted_run() if event_time(e) <= 49.0]
    acc = feed_all(ev)
    before = acc.snapshot(now=60.0)
    assert before.other == pytest.approx(0.5 + 11.0)  # the open 11 s since step 22
    assert before.detection == pytest.approx(1.0)
    assert_adds_up(before)
    acc.feed(Incident(74.0, "hang", t_fault=49.0))
    after = acc.snapshot(now=74.0)
    assert after.detection == pytest.approx(1.0 + 25.0)
    assert after.other == pytest.approx(0.5)
    assert acc.snapshot(now=60.0).detection == pytest.approx(1.0 + 11.0)


def test_steps_thrown_away_stay_productive_until_the_restore_is_known() -> None:
    ev = [e for e in scripted_run() if event_time(e) <= 88.0]
    b = feed_all(ev).snapshot(now=88.0)
    # steps 20-22 of attempt 1 are still on the lineage: attempt 2 has not resumed yet
    assert b.steps_final == 10 + 10 + 3
    assert b.lost == pytest.approx(0.5 + 5)
    assert b.restart == pytest.approx(6.0 + 2.0 + 2.0)  # [74, 76] and [86, 88]
    assert_adds_up(b)


def test_restart_decision_with_its_resume_step_counts_the_loss_at_once() -> None:
    acc = feed_all([*steps(0, 0, 10, 0.0), CheckpointSaved(10.0, 5),
                    RestartDecided(10.0, 1, resume_step=5)])
    b = acc.snapshot(now=12.0)
    assert b.lost == pytest.approx(5.0)  # steps 5-9
    assert b.restart == pytest.approx(2.0)
    assert b.steps_final == 5


def test_snapshot_is_pure_and_incremental_feeding_matches_one_pass() -> None:
    ev = sorted(scripted_run(), key=event_time)
    acc = EttrAccumulator(start=0.0)
    for e in ev:
        acc.feed(e)
        acc.snapshot(now=event_time(e) + 3.0)  # reading between events changes nothing
    assert acc.snapshot(now=500.0) == feed_all(ev).snapshot(now=500.0)


def test_rollback_to_an_old_checkpoint_uses_its_mark_beyond_the_ring() -> None:
    # Ring of 4 steps: the rollback target (step 10) is only known through its mark.
    ev: list[Event] = [*steps(0, 0, 10, 0.0, slow=range(0, 10)), CheckpointSaved(10.0, 10)]
    ev += steps(0, 10, 20, 10.0)
    ev += [RestartDecided(31.0, 1), Resumed(32.0, 1, 10)]
    b = feed_all(ev, config=EttrConfig(ring_steps=4)).snapshot(now=33.0)
    assert b.steps_final == 10
    assert b.lost == pytest.approx(20.0)
    assert b.straggler == pytest.approx(10 * 0.25)  # the kept steps' straggler time, exactly


def test_rollback_to_an_unmarked_step_is_interpolated_between_known_points() -> None:
    ev: list[Event] = [*steps(0, 0, 20, 0.0), RestartDecided(21.0, 1), Resumed(21.0, 1, 5)]
    b = feed_all(ev, config=EttrConfig(ring_steps=2)).snapshot(now=21.0)
    assert b.steps_final == 5
    assert b.lost == pytest.approx(15.0)  # uniform steps: interpolation is exact


def test_untimed_steps_span_from_the_previous_step_less_the_stall() -> None:
    ev: list[Event] = [StepDone(0, s, 10.0 + s, None) for s in range(5)]
    ev += [CheckpointSaved(16.0, 5, stall_s=1.5)]
    ev += [StepDone(0, 5, 17.0, None)]
    b = feed_all(ev).snapshot(now=17.0)
    assert b.startup == pytest.approx(10.0)  # the first untimed step has no start: a gap
    assert b.checkpoint == pytest.approx(1.5)
    assert b.productive == pytest.approx(4.0 + 1.5)  # steps 1-4, then step 5 [15.5, 17]
    assert_adds_up(b)


def test_non_interrupting_incidents_count_no_detection() -> None:
    ev: list[Event] = [*steps(0, 0, 10, 0.0), Incident(8.0, "straggler", t_fault=2.0)]
    b = feed_all(ev).snapshot(now=10.0)
    assert b.detection == 0.0
    assert b.productive == pytest.approx(10 * (1 - DATA))


def test_a_replayed_step_is_lost_not_counted_twice() -> None:
    ev: list[Event] = [*steps(0, 0, 3, 0.0), StepDone(0, 2, 4.0, 1.0)]
    b = feed_all(ev).snapshot(now=4.0)
    assert b.steps_final == 3
    assert b.lost == pytest.approx(1.0)


def test_window_of_two_snapshots() -> None:
    acc = feed_all([e for e in scripted_run() if event_time(e) <= 45.0])
    early = acc.snapshot(now=45.0)
    late = feed_all(scripted_run()).snapshot(now=142.0)
    w = window(early, late)
    assert w.wall_s == pytest.approx(142.0 - 45.0)
    assert w.detection == pytest.approx(25.0 + 2.0)  # the hang's, the spike's
    assert sum(w.parts().values()) == pytest.approx(w.wall_s)


def test_random_event_streams_always_add_up() -> None:
    rng = random.Random(7)
    for trial in range(40):
        t, attempt, step = 0.0, 0, 0
        ev: list[Event] = []
        for _ in range(300):
            t += rng.choice([0.0, 0.1, 0.5, 1.0, 3.0])
            r = rng.random()
            if r < 0.7:
                dur = rng.choice([None, 0.2, 1.0, 5.0])
                ev.append(StepDone(attempt - rng.choice([0, 0, 0, 0, 1]), step, t, dur,
                                   data_s=rng.uniform(0, 2), straggler_s=rng.uniform(0, 2)))
                step += 1
            elif r < 0.78:
                ev.append(CheckpointSaved(t, step - rng.choice([0, 1, 3]), rng.uniform(0, 3)))
            elif r < 0.84:
                ev.append(Incident(t, rng.choice(["crash", "hang", "straggler"]),
                                   t_fault=rng.choice([None, t - rng.uniform(0, 20)])))
            elif r < 0.9:
                attempt += 1
                ev.append(RestartDecided(t, attempt, rng.choice([None, max(0, step - 5)])))
                step = max(0, step - rng.randint(0, 30))
                ev.append(Resumed(t, attempt, step))
            elif r < 0.95:
                ev.append(rng.choice([AgentsDown, AgentsUp])(t))
            else:
                ev.append(RunEnded(t) if rng.random() < 0.3 else AgentsUp(t))
        acc = EttrAccumulator(start=0.0)
        for e in ev:
            acc.feed(e)
            b = acc.snapshot(now=t + 1.0)
            assert sum(b.parts().values()) == pytest.approx(b.wall_s, abs=1e-6), (trial, e)
            assert min(b.parts().values()) >= -1e-9, (trial, e, b.parts())
        assert set(b.parts()) == set(PARTS)


def test_state_stays_small_over_a_long_run() -> None:
    acc = EttrAccumulator(start=0.0, config=EttrConfig(ring_steps=64, max_marks=8))
    for s in range(20_000):
        acc.feed(StepDone(0, s, 1.0 + s, 1.0))
        if s % 100 == 99:
            acc.feed(CheckpointSaved(1.0 + s, s + 1))
    assert len(acc._ring) == 64
    assert len(acc._marks) == 8
    assert acc.snapshot(now=20_001.0).steps_final == 20_000


@pytest.mark.parametrize("row,want", [
    ({"stall_s": 0.4, "save_s": 9.0, "async_save": True}, 0.4),  # what the worker measured
    ({"stall_s": 3.5, "save_s": 3.0, "async_save": False}, 3.5),
    ({"stall_s": None, "save_s": 3.0, "async_save": False}, 3.0),  # older reporters
    ({"stall_s": None, "save_s": 9.0, "async_save": True}, 0.0),  # staging unknown
    ({"stall_s": None, "save_s": None, "async_save": False}, None),
    ({"stall_s": None, "save_s": -1.0, "async_save": False}, None),
    ({"stall_s": -1.0, "save_s": 2.0, "async_save": False}, 2.0),  # a bad stall: save_s
    ({"stall_s": float("nan"), "save_s": 9.0, "async_save": True}, 0.0),
])
def test_save_stall_of_a_checkpoint_row(row: dict[str, object], want: float | None) -> None:
    got = save_stall_s(**row)  # type: ignore[arg-type]
    assert got == (None if want is None else pytest.approx(want))


def test_an_asynchronous_save_moves_its_staging_from_other_to_checkpoint() -> None:
    """Steps of 1 s end at 1, 2, 3.5, 4.5 (a 0.5 s staging after step 2); the save completes
    at 4.2 and is fed after step 4.5: its 0.5 s stall was the gap before step 3.5."""
    acc = EttrAccumulator(start=0.0)
    for step, t in enumerate((1.0, 2.0, 3.5, 4.5)):
        acc.feed(StepDone(0, step, t, 1.0))
    before = acc.snapshot(4.5)
    assert before.other == pytest.approx(0.5)
    acc.feed(CheckpointSaved(t=4.2, step=2, stall_s=0.5, released_at=2.5))
    b = acc.snapshot(4.5)
    assert b.checkpoint == pytest.approx(0.5)
    assert b.other == pytest.approx(0.0)
    assert sum(b.parts().values()) == pytest.approx(b.wall_s)


def test_a_spike_trained_through_is_detection_from_its_first_step_to_the_incident() -> None:
    """Steps 0-19 (step s ends at s + 1), a checkpoint of 5 steps, a loss spike from step 12
    (ended at 13) whose incident opens at 20.5 with a rollback to the checkpoint: detection
    is 20.5 - 13 (steps 13-19 and the gap after them), lost the steps 5-12."""
    acc = feed_all([*steps(0, 0, 20, 0.0), CheckpointSaved(6.0, 5),
                    Incident(t_detected=20.5, kind="loss_spike", t_fault=13.0)])
    b = acc.snapshot(now=20.5)
    assert b.detection == pytest.approx(0.5)  # the steps are still on the lineage
    assert b.steps_final == 20
    acc.feed(RestartDecided(20.5, 1, resume_step=5))
    b = acc.snapshot(now=21.0)
    assert b.detection == pytest.approx(20.5 - 13.0)
    assert b.lost == pytest.approx(8.0)  # steps 5-12
    assert b.restart == pytest.approx(0.5)
    assert b.steps_final == 5
    assert_adds_up(b)


def test_capacity_is_the_shrunk_steps_time_beyond_the_full_world_s() -> None:
    """Steps of a world shrunk to half its nodes take 2 s where the full world takes 1 s:
    1 s of each is ``capacity``, on the lineage like the step's other parts, and lost with
    the step when a restore throws it away.  A planned restart (no incident: the grow back
    at a checkpoint) is restart time and loses nothing."""
    assert "capacity" in PARTS and PARTS.index("capacity") > PARTS.index("straggler")
    ev: list[Event] = [StepDone(0, s, 2.0 * (s + 1), 2.0, capacity_s=1.0) for s in range(10)]
    ev += [CheckpointSaved(20.0, 10),
           RestartDecided(20.0, 1, resume_step=10),  # grow back from the save, 5 s
           Resumed(25.0, 1, 10)]
    ev += [StepDone(1, s, 25.0 + (s - 9), 1.0) for s in range(10, 15)]  # full world again
    b = feed_all(ev).snapshot(now=30.0)
    assert b.capacity == pytest.approx(10 * 1.0)
    assert b.productive == pytest.approx(10 * 1.0 + 5 * 1.0)
    assert b.restart == pytest.approx(5.0) and b.lost == 0.0 and b.steps_final == 15
    assert_adds_up(b)
    # a crash in step 15 rolls back to step 5's checkpoint: shrunk steps 5-9 (capacity and
    # all) and full steps 10-14 are lost
    ev = [*ev[:10], CheckpointSaved(10.0, 5), *ev[10:],
          Incident(31.0, "crash", t_fault=30.5), RestartDecided(31.0, 2, resume_step=5)]
    b = feed_all(ev).snapshot(now=31.0)
    assert b.capacity == pytest.approx(5 * 1.0)
    assert b.lost == pytest.approx(5 * 2.0 + 5 * 1.0 + 0.5)  # and the step in flight
    assert_adds_up(b)


def test_capacity_is_capped_at_what_the_step_leaves() -> None:
    acc = feed_all([StepDone(0, 0, 2.0, 2.0, data_s=0.5, straggler_s=0.5, capacity_s=5.0)])
    b = acc.snapshot(now=2.0)
    assert (b.data_wait, b.straggler, b.capacity, b.productive) == (0.5, 0.5, 1.0, 0.0)


def test_the_wait_for_a_requeued_jobs_new_allocation_is_its_own_part() -> None:
    """A node lost with no spare: the restart waits (restart time), the job is requeued (its
    agents go down with it), and the new allocation's agents register; the time from the
    requeue to the restart decided on the new allocation is ``requeue``, not ``idle``, and
    the restart on it is restart time again."""
    ev: list[Event] = steps(0, 0, 10, 10.0)                # steps 0-9 in [10, 20]
    ev += [CheckpointSaved(20.0, 10)]
    ev += [Incident(26.0, "node_lost", t_fault=20.0),      # detected 6 s after
           RestartDecided(26.0, 1),                        # waits for a node: restart
           Requeued(30.0),                                 # requeued 4 s later
           AgentsDown(31.0), AgentsUp(70.0),               # the new allocation at 70
           RestartDecided(75.0, 2),                        # its agents registered
           Resumed(80.0, 2, 10)]
    ev += steps(2, 10, 10, 81.0)                           # restart [75, 81]; steps 10-19
    ev += [RunEnded(91.0)]
    b = feed_all(ev).snapshot(91.0)
    assert_adds_up(b)
    assert b.requeue == pytest.approx(45.0)  # [30, 75]: idle or not
    assert b.idle == 0.0
    assert b.restart == pytest.approx(4.0 + 6.0)  # [26, 30] and [75, 81]
    assert b.detection == pytest.approx(6.0)
    assert "requeue" in PARTS and b.badput()["requeue"] == b.requeue

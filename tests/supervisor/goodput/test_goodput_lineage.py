"""The final lineage rule (``goodput.lineage.cuts``) on synthetic attempt starts."""

from __future__ import annotations

from trainwarden.supervisor.goodput.lineage import cuts


def test_one_attempt_is_all_lineage() -> None:
    assert cuts({0: 0}) == {0: None}
    assert cuts({}) == {}


def test_a_rollback_supersedes_the_old_attempt_from_the_point_it_went_back_to() -> None:
    # attempt 0 trained on past 1740; attempt 1 resumed at 1740
    assert cuts({0: 0, 1: 1740}) == {0: 1740, 1: None}


def test_each_attempt_is_cut_by_the_earliest_start_after_it() -> None:
    # 1 went back to 100, 2 resumed later at 150 (1's checkpoint), 3 went back to 120:
    # attempt 0 counts below 100, 1 from 100 below 120, 2 none, 3 from 120 on.
    assert cuts({0: 0, 1: 100, 2: 150, 3: 120}) == {0: 100, 1: 120, 2: 120, 3: None}


def test_a_crash_restart_from_the_newest_checkpoint_supersedes_only_the_steps_redone() -> None:
    assert cuts({0: 0, 1: 125, 2: 200}) == {0: 125, 1: 200, 2: None}

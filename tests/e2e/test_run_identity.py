"""A reused run name is another run, through the default state location
(``XDG_STATE_HOME``, no ``--state-dir``): a first run restarts once (attempt 1, a resume plan
naming its own checkpoint), then the same name is started again with its own checkpoint
directory, on the same supervisor (refused: the run has ended) and on a fresh one (it starts
clean at attempt 0, its reports count, the run completes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.system import Agent, Supervisor, ddp_script, wait_until

pytestmark = pytest.mark.e2e

RUN = "reused"
TRAIN = ["--steps", "40", "--hidden", "16", "--seed", "2", "--checkpoint-every-steps", "10"]


def _ended(sup: Supervisor) -> dict | None:
    r = sup.get_or_none(f"/runs/{RUN}")
    return r if r and r["status"] in ("completed", "failed", "stopped") else None


def _train(work: Path, *extra: str) -> list[str]:
    return ["--nproc_per_node=2", "--standalone", *ddp_script(
        *TRAIN, "--checkpoint-dir", str(work / "ck"), "--summary-json",
        str(work / "summary.json"), *extra)]


def test_a_reused_run_name_starts_clean_in_the_default_state_location(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg"
    first, second = tmp_path / "first", tmp_path / "second"
    sup = Supervisor(tmp_path / "supervisor-a").start()
    try:
        agent = Agent(sup.url, RUN, "node0", first, _train(first, "--inject", "crash@25:rank=1"),
                      xdg_state_home=xdg)
        try:
            assert agent.wait(150) == 0, agent.tail()
        finally:
            agent.stop()
        run = wait_until(lambda: _ended(sup), 15, "the first run to end")
        assert run["status"] == "completed", run
        assert run["attempt"] == 1, run  # restarted once: its state holds attempt 1 + a plan
        first_uuid = run["uuid"]

        # The same name on the same supervisor: refused before anything is launched.
        again = Agent(sup.url, RUN, "node0", second, _train(second), xdg_state_home=xdg)
        try:
            assert again.wait(60) == 3, again.tail()
        finally:
            again.stop()
        assert "--run" in again.tail() and "already completed" in again.tail()
        assert not (second / "ck").exists()
    finally:
        sup.stop()

    fresh = Supervisor(tmp_path / "supervisor-b").start()  # a fresh database
    try:
        agent = Agent(fresh.url, RUN, "node0", second, _train(second), xdg_state_home=xdg)
        try:
            assert agent.wait(120) == 0, agent.tail()
        finally:
            agent.stop()
        run = wait_until(lambda: _ended(fresh), 15, "the second run to end")
        assert run["status"] == "completed", run
        assert run["attempt"] == 0, run
        assert run["step"] == 39, run  # its reports were stored: the run's attempt
        assert run["uuid"] != first_uuid
        assert fresh.get(f"/runs/{RUN}/incidents")["incidents"] == []
    finally:
        fresh.stop()
    summary = json.loads((second / "summary.json").read_text())
    assert summary["attempt"] == 0
    assert summary["started_at_step"] == 0
    assert summary["resumed_from"] is None  # not the first run's checkpoint directory
    state = xdg / "trainwarden" / RUN / "node0"
    archived = state.with_name(f"node0.archived-{first_uuid}")
    assert json.loads((archived / "agent.json").read_text())["attempt"] == 1
    assert json.loads((state / "agent.json").read_text())["run_uuid"] == run["uuid"]
    assert f"archived it to {archived}" in agent.tail(20000)

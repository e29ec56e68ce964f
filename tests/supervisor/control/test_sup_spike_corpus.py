"""The corpus of real loss traces (tests/data/loss_traces) replayed through the real ingest
API into a real store, with the real evaluator ticking and the default settings: a spike that
comes back by itself is never rolled back, one that stays (or a NaN) is, in time.

The replay is fast (several steps a tick, as a fast run's agent delivers them);
``benchmarks/spike_detection.py`` replays the same traces at one step a tick against a
supervisor process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from tests.loss_traces import Outcome, load_corpus, replay_in_process
from tests.supervisor.sup_helpers import AGENT, OPERATOR, FakeClock, make_settings
from trainwarden.supervisor.detect import LossSpikeConfig
from trainwarden.supervisor.server.app import create_app
from trainwarden.supervisor.store.db import make_database
from trainwarden.supervisor.store.models import metadata

CORPUS = load_corpus()
WINDOW = LossSpikeConfig().recovery_window_steps  # the default a user gets
STEPS_PER_TICK = 25  # a fast run: 25 steps arrive between two evaluator ticks


def by_label(*labels: str) -> list[str]:
    return [t.name for t in CORPUS if t.label in labels]


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Outcome]]:
    """Every trace replayed once, as its own run on one supervisor (the module shares it)."""
    path: Path = tmp_path_factory.mktemp("corpus") / "replay.db"
    db = make_database(f"sqlite:///{path}", pool_size=4)
    metadata.create_all(db.engine)
    clock = FakeClock()
    app = create_app(make_settings(), db=db, clock=clock, upgrade_schema=False,
                     start_evaluator=False)
    try:
        with TestClient(app) as client:
            out = replay_in_process(CORPUS, http=client, evaluator=app.state.evaluator,
                                    clock=clock, agent_headers=AGENT,
                                    operator_headers=OPERATOR, steps_per_tick=STEPS_PER_TICK,
                                    window=WINDOW)
        yield out
    finally:
        db.dispose()


def test_the_corpus_holds_every_class() -> None:
    labels = [t.label for t in CORPUS]
    assert {lab: labels.count(lab) >= 4 for lab in ("clean", "transient", "sustained",
                                                    "nan")} == dict.fromkeys(
        ("clean", "transient", "sustained", "nan"), True), labels


@pytest.mark.parametrize("name", by_label("clean", "transient"))
def test_a_clean_run_or_a_spike_that_comes_back_is_never_rolled_back(
        outcomes: dict[str, Outcome], name: str) -> None:
    o = outcomes[name]
    assert o.rollbacks == 0, o
    assert o.incidents == 0, o


@pytest.mark.parametrize("name", [n for n in by_label("transient")
                                  if next(t for t in CORPUS if t.name == n).meta[
                                      "label_details"]["back_step"]
                                  - next(t for t in CORPUS if t.name == n).start_step > 1])
def test_a_spike_that_comes_back_is_recorded_as_an_event(
        outcomes: dict[str, Outcome], name: str) -> None:
    assert outcomes[name].transient_events >= 1, outcomes[name]


@pytest.mark.parametrize("name", by_label("sustained", "nan"))
def test_a_spike_that_stays_or_a_nan_is_rolled_back_within_the_window_plus_10_steps(
        outcomes: dict[str, Outcome], name: str) -> None:
    o = outcomes[name]
    assert o.caught, o
    assert o.rollbacks == 1, o
    assert o.detected_delay is not None and o.detected_delay <= WINDOW + 10, o
    # The evaluator acted on the first tick after the deciding step arrived.
    assert o.seen_delay is not None and o.seen_delay - o.detected_delay < STEPS_PER_TICK, o

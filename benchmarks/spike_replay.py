"""Replay a loss-trace corpus through the real ingest API and evaluator in one process, at a
chosen number of steps per evaluator tick, and count what each class of trace got: the check
``tests/supervisor/control/test_sup_spike_corpus.py`` makes on the project's corpus, for any
corpus (a held-out one made by ``benchmarks/make_loss_traces.py --seed-offset N --out DIR``).

    .venv/bin/python benchmarks/make_loss_traces.py --seed-offset 100 --out /tmp/heldout
    .venv/bin/python benchmarks/spike_replay.py /tmp/heldout --steps-per-tick 25
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the replay helpers live in the repository
    sys.path.insert(0, str(REPO))

from fastapi.testclient import TestClient  # noqa: E402

from tests.loss_traces import Outcome, load_corpus, replay_in_process  # noqa: E402
from tests.supervisor.sup_helpers import AGENT, OPERATOR, FakeClock, make_settings  # noqa: E402
from trainwarden.supervisor.detect import LossSpikeConfig  # noqa: E402
from trainwarden.supervisor.server.app import create_app  # noqa: E402
from trainwarden.supervisor.store.db import make_database  # noqa: E402
from trainwarden.supervisor.store.models import metadata  # noqa: E402

SHOULD_ROLL_BACK = {"clean": False, "transient": False, "sustained": True, "nan": True}


def replay(corpus: Path, steps_per_tick: int) -> dict[str, tuple[str, Outcome]]:
    window = LossSpikeConfig().recovery_window_steps
    db = make_database(f"sqlite:///{tempfile.mkdtemp()}/replay.db", pool_size=4)
    metadata.create_all(db.engine)
    clock = FakeClock()
    app = create_app(make_settings(), db=db, clock=clock, upgrade_schema=False,
                     start_evaluator=False)
    corpus_traces = load_corpus(corpus)
    with TestClient(app) as client:
        outcomes = replay_in_process(corpus_traces, http=client, evaluator=app.state.evaluator,
                                     clock=clock, agent_headers=AGENT,
                                     operator_headers=OPERATOR,
                                     steps_per_tick=steps_per_tick, window=window)
    db.dispose()
    return {t.name: (t.label, outcomes[t.name]) for t in corpus_traces}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--steps-per-tick", type=int, default=25)
    args = ap.parse_args()
    res = replay(args.corpus, args.steps_per_tick)
    print("| class | traces | rolled back | wrong |")
    print("|---|---:|---:|---:|")
    for label, should in SHOULD_ROLL_BACK.items():
        sel = {k: o for k, (lab, o) in res.items() if lab == label}
        rolled = [k for k, o in sel.items() if o.rollbacks > 0]
        wrong = [k for k, o in sel.items() if (o.rollbacks > 0) != should]
        print(f"| {label} | {len(sel)} | {len(rolled)} | {len(wrong)} |")
        for k in wrong:
            print(f"|   {k} | | | {sel[k]} |")


if __name__ == "__main__":
    main()

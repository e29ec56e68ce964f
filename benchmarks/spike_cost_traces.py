"""Both figures of every loss-spike verdict on a corpus of real loss traces: the progress the
spike cost and what a rollback would cost, and which is smaller, next to the verdict the
current rule gives.

Each trace (``tests/loss_traces.py``; ``--corpus`` for another directory) is fed one step at a
time to the spike detector with the default settings; at the step a finding is first given
(a ``loss_spike`` incident or a ``loss_spike_transient`` event) the cost is weighed as the
policy does: ``goodput.spike_cost.progress_lost`` over the steps so far, against a rollback
to the newest checkpoint (every ``--checkpoint-every`` steps) at least 10 steps before the
spike, skipping from 10 batches before it through that step.  The traces carry no times:
``--step-s`` and ``--restart-s`` say what a step and a restart cost.

    .venv/bin/python benchmarks/spike_cost_traces.py --step-s 1 --restart-s 60
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.loss_traces import CORPUS_DIR, load_corpus  # noqa: E402
from trainwarden.supervisor.detect import LossSample, LossSpikeTracker  # noqa: E402
from trainwarden.supervisor.detect.findings import FindingKind  # noqa: E402
from trainwarden.supervisor.goodput.spike_cost import progress_lost, weigh  # noqa: E402

KINDS = (FindingKind.LOSS_SPIKE, FindingKind.LOSS_SPIKE_TRANSIENT)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=CORPUS_DIR)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--restart-s", type=float, default=60.0)
    ap.add_argument("--checkpoint-every", type=int, default=50)
    args = ap.parse_args()
    print("| trace | label | verdict (current rule) | at step | spike start | progress lost: "
          "steps (at the end) | rollback: to step, steps | cheaper |")
    print("|---|---|---|---:|---:|---:|---:|---|")
    for tr in load_corpus(args.corpus):
        if tr.label not in ("transient", "sustained"):
            continue
        tracker = LossSpikeTracker()
        seen: set[tuple[str, int | None]] = set()
        rows = 0
        for step, loss in enumerate(tr.loss):
            for f in tracker.feed([LossSample(step=step, loss=loss)]):
                if f.kind not in KINDS or (f.kind, f.step) in seen or f.step is None:
                    continue
                seen.add((f.kind, f.step))
                rows += 1
                hist = [(s, x) for s, x in enumerate(tr.loss[:step + 1])]
                p = progress_lost(hist, start=f.step, step_s=args.step_s,
                                  end_step=len(tr.loss))
                ck = ((f.step - 10) // args.checkpoint_every) * args.checkpoint_every
                ck_step = ck if ck >= 0 else None
                verdict = "rollback" if f.kind == FindingKind.LOSS_SPIKE else "transient: wait"
                if p is None:
                    print(f"| {tr.name} | {tr.label} | {verdict} | {step} | {f.step} | - | - "
                          "| - |")
                    continue
                c = weigh(p, checkpoint_step=ck_step, skipped_batches=step - (f.step - 10) + 1,
                          restart_s=args.restart_s)
                print(f"| {tr.name} | {tr.label} | {verdict} | {step} | {f.step} | "
                      f"{c.lost_steps} ({c.lost_steps_at_end}) | {ck_step}, "
                      f"{c.rollback_steps:.0f} | {c.cheaper} |")
        if not rows:
            print(f"| {tr.name} | {tr.label} | no finding | - | - | - | - | - |")


if __name__ == "__main__":
    main()

"""Loss-spike detection on real loss traces, replayed through a real supervisor process.

Every trace of the corpus (``tests/data/loss_traces``, made by ``benchmarks/
make_loss_traces.py``: tiny models really trained on CPU, clean or with real corruption,
labelled from their own curves) becomes a run of its own on one ``trainwarden supervisor``
subprocess (SQLite, the default settings except the evaluator interval with ``--tick``),
fed through the real ingest API as one node with two ranks, a checkpoint every 50 steps:

* real pace: one step per evaluator tick (``--parallel`` runs at once, a thread each);
* fast: ``--fast-steps`` steps per ingest batch, one batch per tick (a fast run's agent
  delivers a second of steps at once).

Per mode and class: traces, caught (an incident for a sustained or NaN trace), false
incidents and false rollbacks (for clean and transient traces), and the detection delay in
steps from the excursion's start (the label's): to the step where the detector's rule held
(what a rollback's skip is sized from), and to the newest step delivered when the incident
was first seen; and how many were detected within the recovery window + 10 steps.  A NaN
trace's delay is negative when the climb before the NaN was called first.

    .venv/bin/python benchmarks/spike_detection.py
    .venv/bin/python benchmarks/spike_detection.py --modes fast --json /tmp/spike.json
    .venv/bin/python benchmarks/spike_detection.py --corpus /tmp/heldout   # another corpus
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: the helpers live in the repository
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from tests.e2e.system import AGENT_TOKEN, OPERATOR_TOKEN, Supervisor  # noqa: E402
from tests.loss_traces import CLASSES, CORPUS_DIR, Outcome, Replay, Trace, load_corpus  # noqa: E402
from trainwarden.supervisor.detect import LossSpikeConfig  # noqa: E402

WINDOW = LossSpikeConfig().recovery_window_steps  # the supervisor runs with the default


def replay_all(url: str, traces: list[Trace], *, mode: str, tick_s: float, fast_steps: int,
               parallel: int, tag: str) -> list[Outcome]:
    """Every trace, ``parallel`` at a time (a thread each); their outcomes in corpus order.

    The pace is the wall clock: one batch every ``tick_s``.  ``parallel`` is bounded so the
    evaluator, which judges every active run each tick, keeps to its interval on this
    machine (sixty runs at once made a tick take seconds here: the pace would no longer be
    one step a tick)."""
    steps = 1 if mode == "real" else fast_steps
    out: dict[str, Outcome] = {}
    errors: list[str] = []
    slots = threading.Semaphore(parallel)
    agent = {"Authorization": f"Bearer {AGENT_TOKEN}"}
    operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}

    def one(trace: Trace) -> None:
        with slots:
            try:
                with httpx.Client(base_url=url, timeout=30) as http:
                    r = Replay(trace, run=f"{trace.name}-{mode}-{tag}", http=http,
                               agent_headers=agent, operator_headers=operator)
                    next_at = time.monotonic()
                    while not r.done:
                        r.feed(steps)
                        next_at += tick_s
                        time.sleep(max(0.0, next_at - time.monotonic()))
                        r.look()
                    time.sleep(4 * tick_s)  # the evaluator's word on the last steps
                    r.look()
                    r.finish()
                    out[trace.name] = r.outcome(WINDOW)
            except Exception as e:  # reported below; the other traces go on
                errors.append(f"{trace.name}: {e!r}")

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in traces]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        raise SystemExit("replay failed:\n" + "\n".join(errors))
    return [out[t.name] for t in traces]


def table(rows: list[tuple[str, list[Outcome]]]) -> str:
    lines = ["| mode | class | traces | caught | false incidents | false rollbacks | "
             "detected after (steps): median / max | seen after: median / max | "
             "within window + 10 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, outcomes in rows:
        for label in CLASSES:
            group = [o for o in outcomes if o.label == label]
            if not group:
                continue
            if label in ("clean", "transient"):
                lines.append(f"| {mode} | {label} | {len(group)} | - | "
                             f"{sum(o.incidents > 0 for o in group)} | "
                             f"{sum(o.rollbacks > 0 for o in group)} | - | - | - |")
                continue
            det = [o.detected_delay for o in group if o.detected_delay is not None]
            seen = [o.seen_delay for o in group if o.seen_delay is not None]
            lines.append(f"| {mode} | {label} | {len(group)} | "
                         f"{sum(o.caught for o in group)}/{len(group)} | - | - | "
                         f"{_spread(det)} | {_spread(seen)} | "
                         f"{sum(o.in_time for o in group)}/{len(group)} |")
    return "\n".join(lines)


def _spread(xs: list[int]) -> str:
    return f"{statistics.median(xs):g} / {max(xs)}" if xs else "-"


def misses(outcomes: list[Outcome]) -> list[str]:
    """The traces that missed a target, with what happened."""
    out = []
    for o in outcomes:
        if o.label in ("clean", "transient") and (o.incidents or o.rollbacks):
            out.append(f"{o.name} ({o.label}): {o.incidents} incident(s), "
                       f"{o.rollbacks} rollback(s)")
        if o.label in ("sustained", "nan") and not (o.caught and o.in_time):
            out.append(f"{o.name} ({o.label}): caught {o.caught}, detected after "
                       f"{o.detected_delay} steps")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=CORPUS_DIR)
    ap.add_argument("--modes", default="real,fast", help="real, fast or both (real,fast)")
    ap.add_argument("--tick", type=float, default=0.5,
                    help="evaluator interval, seconds (TRAINWARDEN_EVALUATOR_INTERVAL_S; "
                         "the default 0.5 is the supervisor's own)")
    ap.add_argument("--fast-steps", type=int, default=50, help="steps per batch when fast")
    ap.add_argument("--parallel", type=int, default=8, help="traces replayed at once")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write every outcome here")
    args = ap.parse_args()

    traces = load_corpus(args.corpus)
    if not traces:
        raise SystemExit(f"no traces in {args.corpus}: run benchmarks/make_loss_traces.py")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="spike-bench-"))
    sup = Supervisor(work / "sup", env={"TRAINWARDEN_EVALUATOR_INTERVAL_S": str(args.tick)})
    sup.start()
    rows: list[tuple[str, list[Outcome]]] = []
    t0 = time.monotonic()
    tag = uuid.uuid4().hex[:6]
    try:
        for mode in [m for m in args.modes.split(",") if m]:
            if mode not in ("real", "fast"):
                raise SystemExit(f"--modes: unknown mode {mode!r} (real, fast)")
            t = time.monotonic()
            outcomes = replay_all(sup.url, traces, mode=mode, tick_s=args.tick,
                                  fast_steps=args.fast_steps, parallel=args.parallel,
                                  tag=tag)
            print(f"{mode}: {len(traces)} traces replayed in {time.monotonic() - t:.0f} s",
                  flush=True)
            rows.append((mode, outcomes))
    finally:
        sup.stop()
    counts = {lab: sum(t.label == lab for t in traces) for lab in CLASSES}
    print(f"\nloss-spike detection: {len(traces)} real traces from {args.corpus} "
          f"({', '.join(f'{n} {lab}' for lab, n in counts.items())}); one supervisor, "
          f"default settings, evaluator every {args.tick:g} s; real pace = 1 step a tick, "
          f"fast = {args.fast_steps} steps a tick; recovery window {WINDOW} steps; "
          f"{args.parallel} traces at a time; {time.monotonic() - t0:.0f} s in all\n")
    print(table(rows))
    for mode, outcomes in rows:
        for line in misses(outcomes):
            print(f"missed ({mode}): {line}")
    if args.json:
        args.json.write_text(json.dumps({mode: [asdict(o) for o in outcomes]
                                         for mode, outcomes in rows}, indent=1))


if __name__ == "__main__":
    main()

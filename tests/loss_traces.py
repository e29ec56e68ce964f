"""The corpus of real loss traces (``tests/data/loss_traces/``) and how each is labelled.

The traces are tiny models really trained on CPU, with and without real corruption
(``benchmarks/make_loss_traces.py`` makes them).  The label comes from the curve alone,
with rules of its own that do not share code or thresholds with the detector:

* ``nan``: a loss or gradient norm is NaN or Inf;
* an *excursion* starts at the first step whose loss is more than ``jump`` x the median of the
  ``ref_steps`` normal steps before it;  it is *back* at the first later step from which the
  median of ``settle`` steps is within ``back`` x that median again;
* ``transient``: every excursion is back within ``window`` steps of its start;
* ``sustained``: one is not (or never comes back);
* ``clean``: no excursion at all.

``window`` is the recovery window the supervisor's default waits (about 50 steps: a spike
that a run gets over by itself within it is not worth a rollback).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CORPUS_DIR = Path(__file__).resolve().parent / "data" / "loss_traces"
CLASSES = ("clean", "transient", "sustained", "nan")

# Non-finite values are stored as these strings (the files stay standard JSON).
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclass(frozen=True)
class Label:
    label: str
    start_step: int | None = None  # the first excursion that decided the label (or first NaN)
    back_step: int | None = None  # where that excursion was back (None: never)
    peak_ratio: float | None = None  # its highest loss / the median before it
    excursions: int = 0  # how many excursions the curve has


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def label_trace(loss: Sequence[float | None], grad_norm: Sequence[float | None] = (), *,
                jump: float = 2.0, back: float = 1.25, ref_steps: int = 50, settle: int = 5,
                window: int = 50) -> Label:
    """The label of one trace, from its curve (see the module docstring)."""
    bad = [i for i, x in enumerate(loss) if x is not None and not math.isfinite(x)]
    bad += [i for i, x in enumerate(grad_norm) if x is not None and not math.isfinite(x)]
    first_bad = min(bad) if bad else None
    values = [x if _finite(x) else None for x in loss[:first_bad]]
    normal: list[float] = []
    out: Label | None = None
    count = 0
    t = 0
    while t < len(values):
        x = values[t]
        if x is None:
            t += 1
            continue
        if len(normal) < ref_steps:
            normal.append(x)
            t += 1
            continue
        ref = statistics.median(normal[-ref_steps:])
        if x <= jump * ref:
            normal.append(x)
            t += 1
            continue
        count += 1
        peak = x
        back_at = None
        for u in range(t + 1, len(values)):
            tail = [v for v in values[u:u + settle] if v is not None]
            if len(tail) == settle and statistics.median(tail) <= back * ref:
                back_at = u
                break
            v = values[u]
            if v is not None:
                peak = max(peak, v)
        here = Label("transient" if back_at is not None and back_at - t <= window
                     else "sustained", t, back_at, round(peak / ref, 3) if ref else None)
        if out is None or (out.label == "transient" and here.label == "sustained"):
            out = here
        if back_at is None or here.label == "sustained":
            break
        t = back_at
    if first_bad is not None:
        return Label("nan", first_bad, None, None, count)
    if out is None:
        return Label("clean")
    return Label(out.label, out.start_step, out.back_step, out.peak_ratio, count)


@dataclass(frozen=True)
class Trace:
    name: str
    label: str
    loss: list[float]
    grad_norm: list[float | None]
    meta: dict[str, Any]

    @property
    def start_step(self) -> int | None:
        s: int | None = self.meta["label_details"]["start_step"]
        return s


def _value(x: Any) -> float | None:
    if x is None:
        return None
    if isinstance(x, str):
        return _NONFINITE[x]
    return float(x)


def encode(x: float | None) -> float | str | None:
    """A value as stored: non-finite ones as strings."""
    if x is None or math.isfinite(x):
        return x
    return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")


def load_corpus(directory: Path = CORPUS_DIR) -> list[Trace]:
    out = []
    for f in sorted(directory.glob("*.json")):
        d = json.loads(f.read_text())
        loss = [_value(x) for x in d["loss"]]
        out.append(Trace(name=d["name"], label=d["label"],
                         loss=[math.nan if x is None else x for x in loss],
                         grad_norm=[_value(x) for x in d["grad_norm"]],
                         meta={k: v for k, v in d.items() if k not in ("loss", "grad_norm")}))
    return out


# --- replaying a trace through the supervisor's ingest API ---------------------------------

CHECKPOINT_EVERY = 50  # steps, as the e2e runs save


@dataclass
class Replay:
    """One trace fed to a supervisor as a run of one node with two ranks.

    ``feed(n)`` sends the next ``n`` steps in one ingest batch (with a heartbeat, and a
    checkpoint every ``CHECKPOINT_EVERY`` steps); ``look()`` reads the run's incidents and
    notes the newest step delivered when each was first seen.  A replay ends once the
    supervisor has rolled the run back (``rolled_back``) or the trace is used up; then
    ``finish()`` sends the agent's exit and reads the actions and events for ``outcome``."""

    trace: Trace
    run: str
    http: Any  # FastAPI's TestClient, or an httpx.Client with the supervisor's base URL
    agent_headers: dict[str, str]
    operator_headers: dict[str, str]
    clock: Any = time.time  # the time stamped on the steps
    sent: int = 0  # steps delivered
    seq: int = 0
    agent_id: int | None = None
    seen_at: dict[int, int] = field(default_factory=dict)  # incident id -> newest step sent
    incidents: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)

    def register(self) -> None:
        r = self.http.post("/api/v1/agents/register", headers=self.agent_headers, json={
            "run": self.run, "node": "n0", "hostname": "replay", "pid": 1,
            "command": ["replay", self.trace.name], "nproc_per_node": 2,
            "checkpoint_roots": [f"/replay/{self.run}"]})
        assert r.status_code == 200, r.text
        self.agent_id = int(r.json()["agent_id"])
        self.agent_headers = {**self.agent_headers,
                              "X-Trainwarden-Agent-Credential": r.json()["credential"]}

    @property
    def done(self) -> bool:
        return self.sent >= len(self.trace.loss) or self.rolled_back

    @property
    def rolled_back(self) -> bool:
        return any(a["kind"] == "restart" and a["cause"] == "spike" for a in self.actions)

    def feed(self, n: int) -> None:
        if self.agent_id is None:
            self.register()
        now = float(self.clock())
        items: list[dict[str, Any]] = []
        upto = min(len(self.trace.loss), self.sent + n)
        for s in range(self.sent, upto):
            loss, grad = self.trace.loss[s], self.trace.grad_norm[s]
            for rank in (0, 1):
                items.append({"type": "step", "attempt": 0, "rank": rank, "local_rank": rank,
                              "world_size": 2, "step": s, "t": now, "loss": loss,
                              "grad_norm": grad, "samples": 32, "batch_index": s,
                              "data_s": 0.001, "compute_s": 0.01, "step_s": 0.012})
            if (s + 1) % CHECKPOINT_EVERY == 0:
                items.append({"type": "checkpoint", "step": s + 1, "t": now, "bytes": 1,
                              "path": f"/replay/{self.run}/step_{s + 1}", "lineage": "a0",
                              "save_s": 0.01, "attempt": 0})
        items.append({"type": "heartbeat", "t": now, "attempt": 0, "state": "running"})
        # json.dumps, not json=: the wire carries NaN and Infinity tokens.
        body = json.dumps({"agent_id": self.agent_id, "seq": self.seq, "sent_at": now,
                           "attempt": 0, "items": items})
        r = self.http.post("/api/v1/ingest", content=body,
                           headers={**self.agent_headers, "content-type": "application/json"})
        assert r.status_code == 200, r.text
        self.seq += 1
        self.sent = upto

    def _get(self, what: str) -> list[dict[str, Any]]:
        r = self.http.get(f"/api/v1/runs/{self.run}/{what}", headers=self.operator_headers)
        assert r.status_code == 200, r.text
        out: list[dict[str, Any]] = r.json()[what]
        return out

    def look(self) -> None:
        """The run's incidents (and, once there is one, its actions)."""
        self.incidents = self._get("incidents")
        for inc in self.incidents:
            self.seen_at.setdefault(int(inc["id"]), self.sent - 1)
        if self.incidents:
            self.actions = self._get("actions")

    def finish(self) -> None:
        """The agent's exit: the run completes, unless it was rolled back (then the exit is
        an earlier attempt's and the run waits for its restart, costing the evaluator
        nothing)."""
        now = float(self.clock())
        body = json.dumps({"agent_id": self.agent_id, "seq": self.seq, "sent_at": now,
                           "attempt": 0, "items": [
                               {"type": "exit", "attempt": 0, "t": now, "exit_code": 0,
                                "signal": None, "outcome": "completed", "failed_ranks": []}]})
        r = self.http.post("/api/v1/ingest", content=body,
                           headers={**self.agent_headers, "content-type": "application/json"})
        assert r.status_code == 200, r.text
        self.seq += 1
        self.actions, self.events = self._get("actions"), self._get("events")

    def outcome(self, window: int) -> Outcome:
        """What the supervisor made of the trace, judged against its label (after
        ``finish``)."""
        spikes = [i for i in self.incidents if i["kind"] in ("loss_spike", "nonfinite")]
        first = min(spikes, key=lambda i: self.seen_at[int(i["id"])], default=None)
        start = self.trace.start_step
        detected = seen = None
        if first is not None:
            d = first.get("details") or {}
            detected = d.get("detected_at_step", first["step"])
            seen = self.seen_at[int(first["id"])]
        if self.trace.label == "nan":
            caught = any(i["kind"] == "nonfinite" for i in spikes) or (
                first is not None and start is not None and first["step"] <= start)
        else:
            caught = first is not None
        return Outcome(
            name=self.trace.name, label=self.trace.label, start_step=start,
            incidents=len(spikes), rollbacks=sum(a["kind"] == "restart" for a in self.actions),
            transient_events=sum(e["name"] == "loss_spike_transient" for e in self.events),
            caught=caught,
            detected_delay=None if detected is None or start is None else detected - start,
            seen_delay=None if seen is None or start is None else seen - start,
            in_time=(detected is not None and start is not None
                     and detected - start <= window + 10),
        )


@dataclass(frozen=True)
class Outcome:
    name: str
    label: str
    start_step: int | None
    incidents: int  # loss_spike and nonfinite incidents opened
    rollbacks: int  # automatic restarts decided for the run
    transient_events: int
    caught: bool  # an incident for a sustained or NaN trace (any, for the others)
    detected_delay: int | None  # steps from the label's start to where the rule held
    seen_delay: int | None  # ... to the newest step delivered when the incident was seen
    in_time: bool  # detected within the recovery window + 10 steps of the start


def replay_in_process(traces: Sequence[Trace], *, http: Any, evaluator: Any, clock: Any,
                      agent_headers: dict[str, str], operator_headers: dict[str, str],
                      steps_per_tick: int, window: int) -> dict[str, Outcome]:
    """Every trace replayed as its own run against one in-process supervisor, the evaluator
    ticked by hand after each batch of ``steps_per_tick`` steps (half a second apart on
    ``clock``, a ``FakeClock``); the outcomes by trace name."""
    out: dict[str, Outcome] = {}
    for trace in traces:
        r = Replay(trace, run=trace.name, http=http, agent_headers=agent_headers,
                   operator_headers=operator_headers, clock=clock)
        while not r.done:
            clock.advance(0.5)
            r.feed(steps_per_tick)
            evaluator.tick()
            r.look()
        r.finish()
        evaluator.tick()
        out[trace.name] = r.outcome(window)
    return out

"""Failure detectors: pure statistics over windows of measurements.

One statistic a module; no I/O, no database, the clock passed in as ``now``.  The evaluator
reads windows from the store, calls these on every tick and hands the ``Finding`` objects to
the policy, which decides.

* ``hang``: no step progress past a deadline learned from the run's own step intervals (the
  statistic lives in the shared core, ``trainwarden.agent.core.hang``: the agent's watchdog runs it
  too).
* ``straggler``: the rank whose pre-collective time is slow against its peers, sustained.
* ``loss_spike``: loss above a robust rolling baseline, sustained; NaN/Inf at once.
* ``throughput``: tokens/s (or samples/s) below the run's own reference.
* ``node_lost``: an agent's heartbeat older than a deadline.
* ``node_health``: which failures are evidence against a node, and the rule that cordons it
  (the health ledger's; its verdict goes to the policy like any finding).
"""

from trainwarden.agent.core.hang import (
    Deadline,
    HangConfig,
    ProgressWindow,
    RankProgress,
    detect_hang,
    hang_deadline,
    intervals_from_times,
)
from trainwarden.supervisor.detect.findings import EVENT, INCIDENT, Finding, Severity
from trainwarden.supervisor.detect.loss_spike import (
    LossSample,
    LossSpikeConfig,
    LossSpikeTracker,
    detect_loss,
    detect_nonfinite,
    detect_spikes,
    samples_from_pairs,
)
from trainwarden.supervisor.detect.node_lost import NodeLostConfig, detect_lost_nodes
from trainwarden.supervisor.detect.straggler import (
    RankScore,
    StragglerConfig,
    add_pre_collective,
    detect_stragglers,
    pre_collective_table,
    rank_baselines,
    straggler_scores,
)
from trainwarden.supervisor.detect.throughput import (
    ThroughputConfig,
    ThroughputPoint,
    detect_throughput_decay,
    reference_range,
    reference_rate,
)

__all__ = [
    "EVENT",
    "INCIDENT",
    "Deadline",
    "Finding",
    "HangConfig",
    "LossSample",
    "LossSpikeConfig",
    "LossSpikeTracker",
    "NodeLostConfig",
    "ProgressWindow",
    "RankProgress",
    "RankScore",
    "Severity",
    "StragglerConfig",
    "ThroughputConfig",
    "ThroughputPoint",
    "add_pre_collective",
    "detect_hang",
    "detect_loss",
    "detect_lost_nodes",
    "detect_nonfinite",
    "detect_spikes",
    "detect_stragglers",
    "detect_throughput_decay",
    "hang_deadline",
    "intervals_from_times",
    "pre_collective_table",
    "rank_baselines",
    "reference_range",
    "reference_rate",
    "samples_from_pairs",
    "straggler_scores",
]

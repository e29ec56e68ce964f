"""Where a run's time goes: pure accounting and advice (standard library only, no I/O).

* ``ettr``: effective training time ratio and the badput by cause, accumulated
  incrementally from a run's events (``EttrAccumulator.feed`` / ``snapshot``);
* ``lineage``: which attempt's rows stand for each step after restarts (the final lineage);
* ``anatomy``: seconds per phase of a restart from its milestones;
* ``interval``: checkpoint-interval advice (Young/Daly, Meta's expected-ETTR model);
* ``mfu``: MFU bands, per-rank step shares, scaling efficiency and its usual causes;
* ``plan``: the capacity planner behind ``trainwarden plan`` (its command line:
  ``trainwarden.supervisor.cli.plan``);
* ``simulate``: a long run under a failure schedule, as an event stream for the accumulator.
* ``spike_cost``: what a loss spike cost (progress erased) against what a rollback past it
  would cost, both from the run's own figures;
* ``elastic``: a node lost with no spare free: the training lost waiting for a node or
  shrinking to the nodes left, and which to choose.

A figure shown, exported and acted on is computed here once; the store, the API, the
dashboard and ``/metrics`` feed these modules and show what they return.
"""

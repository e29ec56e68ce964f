"""The control loop: observe, decide, act, on the replica that holds the lease.

* ``evaluator``: ``Evaluator.tick()``: store -> detectors -> policy -> actions, each run in
  its own savepoint;
* ``detection``: reads the detectors' windows from the store and runs the detectors
  (``DetectionConfig``);
* ``goodput_feed``: every active run's live goodput, fed each tick, read by the API;
* ``overload``: whether the supervisor keeps up (held-back verdicts, the advised batch
  interval);
* ``observer``: the detectors over every active run, in the evaluator's thread or in a
  process of its own;
* ``policy``: the one place that decides (pure: facts in, typed decisions out);
* ``actions``: carries decisions out (incident, audited action, commands) and advances an
  action's progress from what the agents report;
* ``leader``: which replica runs the evaluator (the lease) and the loop that ticks it;
* ``retention``: the bounded roll-up of old per-rank rows, run at the end of each tick.
"""

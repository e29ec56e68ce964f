"""The evaluation loop (``loop.Evaluator``): ``tick()`` reads the store, asks the policy,
writes actions.  One module a seam, each a part of the one ``Evaluator``:

* ``base``: its settings, what it keeps between ticks, one run's failure kept that run's;
* ``exits``: the agents' exit reports;
* ``membership``: a run's members re-planned (a missing node's rank filled, growing back, a
  cordoned member replaced), an agent on another attempt realigned;
* ``findings``: the detectors' findings and the workers' failure events, stack dumps;
* ``loop``: the tick itself, the overload verdict, presence, goodput, the checkpoints to
  protect, and the thread that ticks.
"""

from __future__ import annotations

from trainwarden.supervisor.control.evaluator.base import EvaluatorConfig, RunState, TickReport
from trainwarden.supervisor.control.evaluator.loop import Evaluator

__all__ = ["Evaluator", "EvaluatorConfig", "RunState", "TickReport"]

"""The pure pieces the agent and the supervisor share: standard library only, no I/O.

The supervisor imports these (``supervisor -> agent`` is allowed, never the other way), so a
GPU node needs none of the service's code and the two sides cannot disagree on them:

* ``findings``: what a detector returns (``Finding``) and the vocabulary of its kinds;
* ``hang``: the hang statistic (progress window, learned deadline, ``detect_hang``), run by
  the supervisor for the whole run and by the agent's own watchdog on what its node sees;
* ``states``: the states and kinds that travel between agent and supervisor (StrEnums);
* ``stats``: the small robust statistics the hang statistic needs.

The wire format itself is ``trainwarden.agent.protocol``.
"""

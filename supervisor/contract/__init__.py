"""The HTTP contract with the node agents: what a request may carry.

* ``wire``: the request models, mirroring ``trainwarden.agent.protocol`` (validated before
  anything is stored);
* ``limits``: the bounds of every number and text field, and the request body size;
* ``checkpoint_paths``: the lexical rules a reported checkpoint path must pass (inside one of
  the agent's registered roots, never a system tree).
"""

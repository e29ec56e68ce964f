"""The ``trainwarden`` console script.

* ``main``: the command line (subcommands import what they need lazily: ``trainwarden agent``
  runs where only the agent extra is installed);
* ``client``: ``runs``, ``incidents``, ``checkpoints``, ``rollback`` ...: thin REST clients;
* ``tables``: plain-text tables (standard library only), every cell made printable;
* ``settings_reference``: the settings reference generated from the settings model.

This package's ``__init__`` imports nothing: the agent's nodes import the console script.
"""

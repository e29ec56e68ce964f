"""trainwarden for training frameworks: callbacks that give a Hugging Face ``Trainer``
(``trainwarden.agent.integrations.hf``, extra ``trainwarden[hf]``) or a PyTorch Lightning
``Trainer``
(``trainwarden.agent.integrations.lightning``, extra ``trainwarden[lightning]``) what the
in-training library
gives a hand-written loop: a report every step, checkpoints the supervisor knows (and may
protect), exact resume, and the supervisor's resume plan (checkpoint, skipped batch ranges, LR
schedule) applied.

Neither framework is imported here: each module imports its own.
"""

"""What the resume tests compare: the global RNG states a training step draws from."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import torch


def global_rng() -> dict[str, str]:
    """A digest of each global RNG a training step draws from (torch, NumPy, Python)."""
    n = np.random.get_state()
    return {"torch": hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest(),
            "numpy": hashlib.sha256(repr((n[0], n[1].tolist(), *n[2:])).encode()).hexdigest(),
            "python": hashlib.sha256(repr(random.getstate()).encode()).hexdigest()}

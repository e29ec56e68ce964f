"""The agent's small JSON state files: read leniently, written atomically.

An agent can die at any instant; a state file is replaced with ``os.replace`` so a reader sees
the old version or the new one, never half of one, and an unreadable file reads as empty.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def load_json(path: Path) -> dict[str, Any]:
    """The file's JSON object, or ``{}`` when it is missing, unreadable or not an object."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def save_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON, atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)

"""The installed version of trainwarden, as the package metadata declares it (one place)."""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "trainwarden"


def version() -> str:
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:  # a source tree used without installing it
        return "0+unknown"

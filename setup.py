"""Packaging glue pyproject.toml cannot express: one import root, ``trainwarden``, over the
repository's top-level folders (``trainwarden/`` holds the root's own ``__init__``,
``supervisor/`` is ``trainwarden.supervisor``, ``agent/`` is ``trainwarden.agent``, and
``migrations/`` ships inside the wheel as ``trainwarden.supervisor.migrations``)."""

from setuptools import find_packages, setup

FOLDERS = {"trainwarden.supervisor": "supervisor", "trainwarden.agent": "agent",
           "trainwarden.supervisor.migrations": "migrations",
           "trainwarden.supervisor.migrations.versions": "migrations/versions"}

setup(
    packages=["trainwarden", *(f"{root}.{sub}" if sub else root
                               for root, folder in FOLDERS.items()
                               for sub in ["", *find_packages(where=folder)])],
    package_dir={"trainwarden": "trainwarden", **FOLDERS},
)

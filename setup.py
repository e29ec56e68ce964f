"""Packaging glue pyproject.toml cannot express: the top-level ``migrations/`` folder ships
inside the wheel as the ``supervisor.migrations`` package."""

from setuptools import find_packages, setup

MIGRATIONS = {"supervisor.migrations": "migrations",
              "supervisor.migrations.versions": "migrations/versions"}

setup(
    packages=[*find_packages(include=["agent*", "supervisor*"]), *MIGRATIONS],
    package_dir=MIGRATIONS,
)

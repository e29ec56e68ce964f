"""Fixtures: see ``tests/dashboard/apps.py``."""

from tests.dashboard.apps import app, client, clock, db, evaluator

__all__ = ["app", "client", "clock", "db", "evaluator"]

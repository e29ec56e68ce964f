"""Persistence: models (schema), db (engines), repo (every SQL statement)."""

"""HTTP API under /api/v1: dependencies (deps), agent routes (agents), run routes (runs)."""

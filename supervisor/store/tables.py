"""Core ``Table`` handles for the models, typed for the statements of this package."""

from __future__ import annotations

from typing import cast

from sqlalchemy import Table

from trainwarden.supervisor.store import models

runs = cast(Table, models.Run.__table__)
agents = cast(Table, models.Agent.__table__)
agent_credentials = cast(Table, models.AgentCredential.__table__)
api_tokens = cast(Table, models.ApiToken.__table__)
ranks = cast(Table, models.Rank.__table__)
rank_steps = cast(Table, models.RankStep.__table__)
step_aggregates = cast(Table, models.StepAggregate.__table__)
rank_rollups = cast(Table, models.RankRollup.__table__)
step_batches = cast(Table, models.StepBatch.__table__)
checkpoints = cast(Table, models.Checkpoint.__table__)
events = cast(Table, models.Event.__table__)
exits = cast(Table, models.Exit.__table__)
incidents = cast(Table, models.Incident.__table__)
actions = cast(Table, models.Action.__table__)
commands = cast(Table, models.Command.__table__)
ingested_batches = cast(Table, models.IngestedBatch.__table__)
evaluator_lease = cast(Table, models.EvaluatorLease.__table__)
hosts = cast(Table, models.Host.__table__)
host_evidence = cast(Table, models.HostEvidence.__table__)
host_actions = cast(Table, models.HostAction.__table__)

"""retention: per-rank summaries of the rank step rows rolled up beyond the kept window
(rank_rollups), and rank 0's batch index of each rolled-up step (step_batches)

Revision ID: 0010_rank_rollups
Revises: 0009_evaluator_lease
Create Date: 2026-12-02 05:40:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_rank_rollups"
down_revision: str | Sequence[str] | None = "0009_evaluator_lease"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    counted = ["data_s", "compute_s", "step_s"]
    op.create_table(
        "rank_rollups",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.Integer(), nullable=False),
        sa.Column("bucket_steps", sa.Integer(), nullable=False),
        sa.Column("rows", sa.Integer(), nullable=False),
        sa.Column("step_first", sa.Integer(), nullable=False),
        sa.Column("step_last", sa.Integer(), nullable=False),
        sa.Column("t_first", sa.Float(), nullable=False),
        sa.Column("t_last", sa.Float(), nullable=False),
        *[col for name in counted for col in (
            sa.Column(f"{name}_n", sa.Integer(), nullable=False),
            sa.Column(f"{name}_sum", sa.Float(), nullable=True),
            sa.Column(f"{name}_max", sa.Float(), nullable=True),
        )],
        sa.Column("loss_n", sa.Integer(), nullable=False),
        sa.Column("loss_sum", sa.Float(), nullable=True),
        sa.Column("loss_min", sa.Float(), nullable=True),
        sa.Column("loss_max", sa.Float(), nullable=True),
        sa.Column("loss_nonfinite", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_rank_rollups_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "attempt", "rank", "bucket_start",
                                name=op.f("pk_rank_rollups")),
    )
    op.create_table(
        "step_batches",
        sa.Column("run_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("step", sa.Integer(), nullable=False),
        sa.Column("batch_index", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(
            ["run_id"], ["runs.id"], name=op.f("fk_step_batches_run_id_runs"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("run_id", "attempt", "step", name=op.f("pk_step_batches")),
    )


def downgrade() -> None:
    op.drop_table("step_batches")
    op.drop_table("rank_rollups")

"""node health and checkpoint protection: disk total, worker stats and GPU readings per
agent; the checkpoints a run's retention must keep; the step a rollback action goes back to

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01 09:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agents") as b:
        b.add_column(sa.Column("disk_total_bytes", sa.BigInteger(), nullable=True))
        b.add_column(sa.Column("workers", sa.JSON(), nullable=True))
        b.add_column(sa.Column("gpus", sa.JSON(), nullable=True))
    with op.batch_alter_table("runs") as b:
        b.add_column(sa.Column("protected", sa.JSON(), nullable=True))
    with op.batch_alter_table("actions") as b:
        b.add_column(sa.Column("rollback_to_step", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("actions") as b:
        b.drop_column("rollback_to_step")
    with op.batch_alter_table("runs") as b:
        b.drop_column("protected")
    with op.batch_alter_table("agents") as b:
        b.drop_column("gpus")
        b.drop_column("workers")
        b.drop_column("disk_total_bytes")

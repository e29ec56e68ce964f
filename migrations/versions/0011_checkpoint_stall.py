"""checkpoint stall: how long each save blocked the training loop (stall_s), as the worker
measured it; rows of earlier reporters keep NULL (their stall is read from save_s)

Revision ID: 0011_checkpoint_stall
Revises: 0010_rank_rollups
Create Date: 2026-12-02 14:40:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_checkpoint_stall"
down_revision: str | Sequence[str] | None = "0010_rank_rollups"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("checkpoints") as b:
        b.add_column(sa.Column("stall_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as b:
        b.drop_column("stall_s")

"""elastic runs: runs.min_nodes (the smallest world the run accepts; null: the declared one,
it never shrinks) and runs.world_nnodes (the nodes the current attempt runs on; null: the
declared world)

Revision ID: 0014_elastic
Revises: 0013_hosts
Create Date: 2026-12-06 09:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014_elastic"
down_revision: str | Sequence[str] | None = "0013_hosts"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as b:
        b.add_column(sa.Column("min_nodes", sa.Integer(), nullable=True))
        b.add_column(sa.Column("world_nnodes", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as b:
        b.drop_column("world_nnodes")
        b.drop_column("min_nodes")

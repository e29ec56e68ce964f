"""recovery: the cause and progress mark of each restart action

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 10:20:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("actions") as b:
        b.add_column(sa.Column("cause", sa.String(length=20), nullable=True))
        b.add_column(sa.Column("high_step", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("actions") as b:
        b.drop_column("high_step")
        b.drop_column("cause")

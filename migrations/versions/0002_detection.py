"""detection: incident step and updated_at, command collect_stacks, abandoned checkpoints

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 09:30:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # batch mode: SQLite cannot ALTER most things in place; Alembic copies the table there.
    with op.batch_alter_table("incidents") as b:
        b.add_column(sa.Column("step", sa.Integer(), nullable=True))
        b.add_column(sa.Column("updated_at", sa.Float(), nullable=True))
    with op.batch_alter_table("commands") as b:
        b.add_column(sa.Column("collect_stacks", sa.Boolean(), nullable=False,
                               server_default=sa.false()))
    with op.batch_alter_table("checkpoints") as b:
        b.add_column(sa.Column("abandoned", sa.Boolean(), nullable=False,
                               server_default=sa.false()))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as b:
        b.drop_column("abandoned")
    with op.batch_alter_table("commands") as b:
        b.drop_column("collect_stacks")
    with op.batch_alter_table("incidents") as b:
        b.drop_column("updated_at")
        b.drop_column("step")

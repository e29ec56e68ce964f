"""the evaluator lease: which supervisor replica on a shared Postgres runs the evaluator, and
the fencing epoch its decisions are checked against

Revision ID: 0009_evaluator_lease
Revises: 0008
Create Date: 2026-12-02 05:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_evaluator_lease"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "evaluator_lease",
        sa.Column("name", sa.String(50), nullable=False),
        sa.Column("holder", sa.String(200), nullable=False),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.Float(), nullable=False),
        sa.Column("renewed_at", sa.Float(), nullable=False),
        sa.Column("expires_at", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("name", name="pk_evaluator_lease"),
    )


def downgrade() -> None:
    op.drop_table("evaluator_lease")

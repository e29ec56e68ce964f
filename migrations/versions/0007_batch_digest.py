"""ingest replays: the content digest of each stored batch, so that a replayed (agent, seq)
with different content is refused instead of answered as a duplicate

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 01:30:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("ingested_batches") as b:
        b.add_column(sa.Column("digest", sa.String(32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("ingested_batches") as b:
        b.drop_column("digest")

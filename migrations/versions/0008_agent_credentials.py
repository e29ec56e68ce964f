"""per-agent credentials: the SHA-256 digest of the secret each agent proves itself with on
every ingest (issued at registration, replaced by a takeover)

Revision ID: 0008
Revises: 0005
Create Date: 2026-12-02 02:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "agent_credentials",
        sa.Column("agent_id", sa.Integer(), nullable=False),
        sa.Column("secret_hash", sa.String(71), nullable=True),
        sa.Column("revoked_hash", sa.String(71), nullable=True),
        sa.Column("issued_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["agent_id"], ["agents.id"], ondelete="CASCADE",
                                name="fk_agent_credentials_agent_id_agents"),
        sa.PrimaryKeyConstraint("agent_id", name="pk_agent_credentials"),
    )


def downgrade() -> None:
    op.drop_table("agent_credentials")

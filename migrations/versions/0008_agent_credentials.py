"""per-agent credentials (the SHA-256 digest of the secret each agent proves itself with on
every ingest: issued at registration, replaced by a takeover) and tokens with roles

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02 02:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
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
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("role", sa.String(20), nullable=False),
        sa.Column("scope", sa.String(201), nullable=True),
        sa.Column("secret_hash", sa.String(71), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("last_used_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("id", name="pk_api_tokens"),
        sa.UniqueConstraint("name", name="uq_api_tokens_name"),
        sa.UniqueConstraint("secret_hash", name="uq_api_tokens_secret_hash"),
    )


def downgrade() -> None:
    op.drop_table("api_tokens")
    op.drop_table("agent_credentials")

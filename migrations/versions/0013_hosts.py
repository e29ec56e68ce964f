"""hosts: the per-node health ledger.  hosts (each node's state: healthy, cordoned or on
probation, why, who, since when, and the GPU counters last seen), host_evidence (the evidence
against a node, each source recorded once) and host_actions (every cordon, uncordon and
passed probation, audited)

Revision ID: 0013_hosts
Revises: 0012_membership
Create Date: 2026-12-06 04:30:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013_hosts"
down_revision: str | Sequence[str] | None = "0012_membership"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "hosts",
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("actor", sa.String(100), nullable=False),
        sa.Column("since", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("cleared_at", sa.Float(), nullable=True),
        sa.Column("gpu_counters", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("node", name=op.f("pk_hosts")),
    )
    op.create_table(
        "host_evidence",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(30), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("t", sa.Float(), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.Column("source", sa.String(200), nullable=True),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_host_evidence_run_id_runs"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_host_evidence")),
        sa.UniqueConstraint("node", "source", name=op.f("uq_host_evidence_node")),
    )
    with op.batch_alter_table("host_evidence") as b:
        b.create_index("ix_host_evidence_node_t", ["node", "t"], unique=False)
    op.create_table(
        "host_actions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("actor", sa.String(100), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("run_id", sa.Integer(), nullable=True),
        sa.Column("evidence_ids", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.id"],
                                name=op.f("fk_host_actions_run_id_runs"), ondelete="SET NULL"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_host_actions")),
    )
    with op.batch_alter_table("host_actions") as b:
        b.create_index("ix_host_actions_node", ["node"], unique=False)


def downgrade() -> None:
    op.drop_table("host_actions")
    op.drop_table("host_evidence")
    op.drop_table("hosts")

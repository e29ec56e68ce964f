"""membership: the supervisor decides each attempt's members.  agents.role (member or
spare), agents.node_rank (the node rank a member holds), agents.address (where its torchrun
can host the rendezvous), agents.devices (its capacity, with nproc_per_node),
agents.joined_as (what it registered as: a run that had a spare is told when none is left);
runs.epoch (the membership epoch: it grows whenever the members change) and runs.nnodes (the
declared world)

Revision ID: 0012_membership
Revises: 0011_checkpoint_stall
Create Date: 2026-12-05 06:10:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_membership"
down_revision: str | Sequence[str] | None = "0011_checkpoint_stall"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agents") as b:
        b.add_column(sa.Column("role", sa.String(16), nullable=False, server_default="member"))
        b.add_column(sa.Column("node_rank", sa.Integer(), nullable=True))
        b.add_column(sa.Column("address", sa.String(255), nullable=False, server_default=""))
        b.add_column(sa.Column("devices", sa.Integer(), nullable=True))
        b.add_column(sa.Column("joined_as", sa.String(16), nullable=False,
                               server_default="member"))
    with op.batch_alter_table("runs") as b:
        b.add_column(sa.Column("epoch", sa.Integer(), nullable=False, server_default="0"))
        b.add_column(sa.Column("nnodes", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("runs") as b:
        b.drop_column("nnodes")
        b.drop_column("epoch")
    with op.batch_alter_table("agents") as b:
        b.drop_column("joined_as")
        b.drop_column("devices")
        b.drop_column("address")
        b.drop_column("node_rank")
        b.drop_column("role")

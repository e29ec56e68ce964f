"""trust: evidence bounded by its source.  agents.host_trusted (the agent registered with a
token trusted for its host: one not scoped to runs), agents.cordon (a cordon of the node in
this run only, from evidence of a source not trusted for the host), agents.gpu_counters (the
NVML counters last seen from an agent not trusted for its host), agents.lost_at (when the
node's death was confirmed before the node-lost deadline), events.member (the agent was
a member of its run when the event arrived: only members' events are acted on),
host_evidence.trusted (false: the evidence counts in its run only) and runs.launcher (the
shape of the first member's command: "torchrun" or "plain"; null before any member)

Revision ID: 0015_trust
Revises: 0014_elastic
Create Date: 2026-12-06 12:00:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015_trust"
down_revision: str | Sequence[str] | None = "0014_elastic"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agents") as b:
        b.add_column(sa.Column("host_trusted", sa.Boolean(), nullable=False,
                               server_default=sa.true()))
        b.add_column(sa.Column("cordon", sa.Text(), nullable=True))
        b.add_column(sa.Column("gpu_counters", sa.JSON(), nullable=True))
        b.add_column(sa.Column("lost_at", sa.Float(), nullable=True))
    with op.batch_alter_table("events") as b:
        b.add_column(sa.Column("member", sa.Boolean(), nullable=False,
                               server_default=sa.true()))
    with op.batch_alter_table("host_evidence") as b:
        b.add_column(sa.Column("trusted", sa.Boolean(), nullable=False,
                               server_default=sa.true()))
    with op.batch_alter_table("runs") as b:
        b.add_column(sa.Column("launcher", sa.String(16), nullable=True))
    # A run with members has its settings fixed: a declared world is a torchrun launch's.
    op.execute("UPDATE runs SET launcher = 'torchrun' WHERE nnodes IS NOT NULL")
    op.execute("UPDATE runs SET launcher = 'plain' WHERE nnodes IS NULL AND EXISTS "
               "(SELECT 1 FROM agents WHERE agents.run_id = runs.id "
               "AND agents.joined_as = 'member')")


def downgrade() -> None:
    with op.batch_alter_table("runs") as b:
        b.drop_column("launcher")
    with op.batch_alter_table("host_evidence") as b:
        b.drop_column("trusted")
    with op.batch_alter_table("events") as b:
        b.drop_column("member")
    with op.batch_alter_table("agents") as b:
        b.drop_column("lost_at")
        b.drop_column("gpu_counters")
        b.drop_column("cordon")
        b.drop_column("host_trusted")

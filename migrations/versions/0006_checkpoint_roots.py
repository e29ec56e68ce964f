"""checkpoint roots: the directories each agent registered (every checkpoint path it reports
must lie inside one); an agent registered with the single root of earlier versions keeps it

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 01:30:00

"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("agents") as b:
        b.add_column(sa.Column("checkpoint_roots", sa.JSON(), nullable=True))
    agents = sa.table("agents", sa.column("id", sa.Integer()),
                      sa.column("checkpoint_root", sa.Text()),
                      sa.column("checkpoint_roots", sa.JSON()))
    conn = op.get_bind()
    rows = conn.execute(sa.select(agents.c.id, agents.c.checkpoint_root)
                        .where(agents.c.checkpoint_root.is_not(None))).all()
    for agent_id, root in rows:
        conn.execute(sa.update(agents).where(agents.c.id == agent_id)
                     .values(checkpoint_roots=[root]))


def downgrade() -> None:
    with op.batch_alter_table("agents") as b:
        b.drop_column("checkpoint_roots")

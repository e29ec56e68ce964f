"""run identity: every run gets a uuid at creation (the registration reply carries it, and an
agent's local state belongs to it rather than to the run's name)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 01:00:00

"""

import uuid
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("runs") as b:
        b.add_column(sa.Column("uuid", sa.String(36), nullable=True))
    conn = op.get_bind()
    runs = sa.table("runs", sa.column("id", sa.Integer()), sa.column("uuid", sa.String(36)))
    for (run_id,) in conn.execute(sa.select(runs.c.id)).all():
        conn.execute(runs.update().where(runs.c.id == run_id).values(uuid=str(uuid.uuid4())))
    with op.batch_alter_table("runs") as b:
        b.alter_column("uuid", existing_type=sa.String(36), nullable=False)
        b.create_unique_constraint("uq_runs_uuid", ["uuid"])


def downgrade() -> None:
    with op.batch_alter_table("runs") as b:
        b.drop_constraint("uq_runs_uuid", type_="unique")
        b.drop_column("uuid")

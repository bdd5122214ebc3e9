"""grants name their owner; release is a delivery kind

Revision ID: 0002
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('owner', sa.String(length=128), nullable=True))
    with op.batch_alter_table('deliveries', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_deliveries_kind'), type_='check')
        batch_op.create_check_constraint(
            op.f('ck_deliveries_kind'), "kind IN ('heartbeat', 'result', 'release')"
        )


def downgrade() -> None:
    op.execute("DELETE FROM deliveries WHERE kind = 'release'")
    with op.batch_alter_table('deliveries', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_deliveries_kind'), type_='check')
        batch_op.create_check_constraint(op.f('ck_deliveries_kind'), "kind IN ('heartbeat', 'result')")
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.drop_column('owner')

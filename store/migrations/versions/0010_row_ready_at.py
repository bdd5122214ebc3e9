"""a row keeps when the board said its task turned ready (ready_at): the claim's wait, durable

Revision ID: 0010
Revises: 0009
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: str | None = '0009'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.add_column(sa.Column('ready_at', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.drop_column('ready_at')

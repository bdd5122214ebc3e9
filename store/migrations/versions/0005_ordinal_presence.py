"""ordinal presence: the last worker call and owner per ordinal

Revision ID: 0005
Revises: 0004
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

CALLS = ('offer', 'heartbeat', 'result')


def upgrade() -> None:
    op.create_table('ordinal_presence',
    sa.Column('ordinal', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('owner', sa.String(length=128), nullable=True),
    sa.Column('call', sa.String(length=16), nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.CheckConstraint('call IN (' + ', '.join(f"'{c}'" for c in CALLS) + ')', name=op.f('ck_ordinal_presence_call')),
    sa.PrimaryKeyConstraint('ordinal', name=op.f('pk_ordinal_presence')),
    )


def downgrade() -> None:
    op.drop_table('ordinal_presence')

"""board pauses: dispatch paused for one board alone (one row per paused board, deleted on resume)

Revision ID: 0009
Revises: 0008
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: str | None = '0008'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('board_pauses',
    sa.Column('board', sa.String(length=64), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('actor', sa.String(length=64), nullable=False),
    sa.Column('since', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('board', name=op.f('pk_board_pauses')),
    )


def downgrade() -> None:
    op.drop_table('board_pauses')

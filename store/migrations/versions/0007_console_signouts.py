"""console sign-outs: sessions ended before they expired, for every serve replica

Revision ID: 0007
Revises: 0006
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0007'
down_revision: str | None = '0006'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('console_signouts',
    sa.Column('nonce', sa.String(length=32), nullable=False),
    sa.Column('expires', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('nonce', name=op.f('pk_console_signouts')),
    )
    op.create_index(op.f('ix_console_signouts_expires'), 'console_signouts', ['expires'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_console_signouts_expires'), table_name='console_signouts')
    op.drop_table('console_signouts')

"""claim request ids: a retried claim returns the claims it made

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
    op.create_table('claim_requests',
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('claims', sa.Text(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('request_id', name=op.f('pk_claim_requests'))
    )
    with op.batch_alter_table('claim_requests', schema=None) as batch_op:
        batch_op.create_index('ix_claim_requests_created_at', ['created_at'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('claim_requests', schema=None) as batch_op:
        batch_op.drop_index('ix_claim_requests_created_at')

    op.drop_table('claim_requests')

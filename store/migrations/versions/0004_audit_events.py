"""audit events: one per transition, appended in its transaction

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = (
    'claim', 'grant', 'expiry', 'result', 'release', 'settle', 'requeue',
    'abandon', 'cancel', 'failure', 'quarantine', 'children_retired',
)


def upgrade() -> None:
    op.create_table('audit_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), autoincrement=True, nullable=False),
    sa.Column('row_id', sa.Integer(), nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('kind', sa.String(length=24), nullable=False),
    sa.Column('from_state', sa.String(length=16), nullable=True),
    sa.Column('to_state', sa.String(length=16), nullable=True),
    sa.Column('attempt', sa.Integer(), nullable=True),
    sa.Column('fence', sa.BigInteger(), nullable=True),
    sa.Column('actor', sa.String(length=64), nullable=False),
    sa.Column('detail', sa.Text(), nullable=True),
    sa.CheckConstraint('kind IN (' + ', '.join(f"'{k}'" for k in KINDS) + ')', name=op.f('ck_audit_events_kind')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_events')),
    )
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.create_index('ix_audit_events_row_id', ['row_id', 'id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.drop_index('ix_audit_events_row_id')
    op.drop_table('audit_events')

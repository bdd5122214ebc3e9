"""child executions: a run's lineage, retired with its grant

Revision ID: 0003
Revises: 0002
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _child_id() -> sa.types.TypeEngine[str]:
    # Prefix ranges on the primary key need bytewise order: PostgreSQL gets the "C" collation.
    return sa.String(length=1280).with_variant(sa.String(length=1280, collation='C'), 'postgresql')


def upgrade() -> None:
    op.create_table('child_executions',
    sa.Column('id', _child_id(), nullable=False),
    sa.Column('row_id', sa.Integer(), nullable=False),
    sa.Column('parent_id', _child_id(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('outcome', sa.String(length=16), nullable=True),
    sa.Column('epoch', sa.BigInteger(), nullable=False),
    sa.Column('depth', sa.Integer(), nullable=False),
    sa.Column('receipt', sa.Text(), nullable=True),
    sa.Column('receipt_digest', sa.String(length=64), nullable=True),
    sa.Column('result_digest', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.CheckConstraint("(status = 'terminal') = (outcome IS NOT NULL)", name=op.f('ck_child_executions_terminal_has_outcome')),
    sa.CheckConstraint("outcome IN ('done', 'retired', 'discarded')", name=op.f('ck_child_executions_outcome')),
    sa.CheckConstraint("outcome IS NULL OR outcome <> 'done' OR result_digest IS NOT NULL", name=op.f('ck_child_executions_done_has_digest')),
    sa.CheckConstraint("receipt IS NULL OR receipt_digest IS NOT NULL", name=op.f('ck_child_executions_receipt_has_digest')),
    sa.CheckConstraint("status <> 'terminal' OR receipt IS NULL", name=op.f('ck_child_executions_terminal_compacted')),
    sa.CheckConstraint("status IN ('registered', 'running', 'terminal', 'unknown')", name=op.f('ck_child_executions_status')),
    sa.CheckConstraint('depth >= 1', name=op.f('ck_child_executions_depth')),
    sa.ForeignKeyConstraint(['row_id'], ['assignments.id'], name='fk_child_executions_row'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_child_executions'))
    )
    with op.batch_alter_table('child_executions', schema=None) as batch_op:
        batch_op.create_index('ix_child_executions_row_id', ['row_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('child_executions', schema=None) as batch_op:
        batch_op.drop_index('ix_child_executions_row_id')
    op.drop_table('child_executions')

"""initial pool store schema

Revision ID: 0001
Revises: 
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('assignments',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('board', sa.String(length=64), nullable=False),
    sa.Column('task_id', sa.String(length=128), nullable=False),
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('ordinal', sa.Integer(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('fence', sa.BigInteger(), nullable=True),
    sa.Column('lease_until', sa.Float(), nullable=True),
    sa.Column('payload', sa.Text(), nullable=True),
    sa.Column('payload_digest', sa.String(length=64), nullable=False),
    sa.Column('result', sa.Text(), nullable=True),
    sa.Column('result_digest', sa.String(length=64), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('failures', sa.Integer(), server_default='0', nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('next_attempt_at', sa.Float(), server_default='0', nullable=False),
    sa.Column('quarantined', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.CheckConstraint("(state IN ('finalized', 'stale')) OR payload IS NOT NULL", name=op.f('ck_assignments_live_has_payload')),
    sa.CheckConstraint("NOT (state IN ('finalized', 'stale')) OR (payload IS NULL AND result IS NULL)", name=op.f('ck_assignments_terminal_compacted')),
    sa.CheckConstraint("state <> 'result' OR result_digest IS NOT NULL", name=op.f('ck_assignments_result_has_digest')),
    sa.CheckConstraint("state <> 'running' OR (lease_until IS NOT NULL AND fence IS NOT NULL)", name=op.f('ck_assignments_running_has_lease')),
    sa.CheckConstraint("state IN ('assigned', 'running', 'result', 'lease_failed', 'finalized', 'stale')", name=op.f('ck_assignments_state')),
    sa.CheckConstraint('attempt >= 1', name=op.f('ck_assignments_attempt')),
    sa.CheckConstraint('failures >= 0', name=op.f('ck_assignments_failures')),
    sa.CheckConstraint('ordinal >= 0', name=op.f('ck_assignments_ordinal')),
    sa.CheckConstraint('run_id >= 1', name=op.f('ck_assignments_run_id')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_assignments')),
    sa.UniqueConstraint('board', 'task_id', 'run_id', name='uq_assignments_identity'),
    sqlite_autoincrement=True,
    )
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.create_index('ix_assignments_board_state', ['board', 'state'], unique=False)
        batch_op.create_index('ix_assignments_running_lease', ['lease_until'], unique=False, sqlite_where=sa.text("state = 'running'"), postgresql_where=sa.text("state = 'running'"))
        batch_op.create_index('ix_assignments_state_due', ['state', 'next_attempt_at'], unique=False)
        batch_op.create_index('ix_assignments_terminal_age', ['updated_at'], unique=False, sqlite_where=sa.text("state IN ('finalized', 'stale')"), postgresql_where=sa.text("state IN ('finalized', 'stale')"))
        batch_op.create_index('ux_assignments_live_ordinal', ['ordinal'], unique=True, sqlite_where=sa.text("state IN ('assigned', 'running', 'result')"), postgresql_where=sa.text("state IN ('assigned', 'running', 'result')"))

    op.create_table('deliveries',
    sa.Column('delivery_id', sa.String(length=128), nullable=False),
    sa.Column('assignment_id', sa.Integer(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('digest', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.CheckConstraint("kind IN ('heartbeat', 'result')", name=op.f('ck_deliveries_kind')),
    sa.PrimaryKeyConstraint('delivery_id', name=op.f('pk_deliveries'))
    )
    with op.batch_alter_table('deliveries', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_deliveries_created_at'), ['created_at'], unique=False)

    fence_sequence = op.create_table('fence_sequence',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('value', sa.BigInteger(), nullable=False),
    sa.CheckConstraint('id = 1', name=op.f('ck_fence_sequence_single_row')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_fence_sequence'))
    )
    op.bulk_insert(fence_sequence, [{"id": 1, "value": 0}])


def downgrade() -> None:
    op.drop_table('fence_sequence')
    with op.batch_alter_table('deliveries', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_deliveries_created_at'))

    op.drop_table('deliveries')
    with op.batch_alter_table('assignments', schema=None) as batch_op:
        batch_op.drop_index('ux_assignments_live_ordinal', sqlite_where=sa.text("state IN ('assigned', 'running', 'result')"), postgresql_where=sa.text("state IN ('assigned', 'running', 'result')"))
        batch_op.drop_index('ix_assignments_terminal_age', sqlite_where=sa.text("state IN ('finalized', 'stale')"), postgresql_where=sa.text("state IN ('finalized', 'stale')"))
        batch_op.drop_index('ix_assignments_state_due')
        batch_op.drop_index('ix_assignments_running_lease', sqlite_where=sa.text("state = 'running'"), postgresql_where=sa.text("state = 'running'"))
        batch_op.drop_index('ix_assignments_board_state')

    op.drop_table('assignments')

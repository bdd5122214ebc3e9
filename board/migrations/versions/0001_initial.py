"""initial board schema

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
    op.create_table('boards',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('archived', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('name', name=op.f('pk_boards'))
    )
    op.create_table('runs',
    sa.Column('board', sa.String(length=64), nullable=False),
    sa.Column('task_id', sa.String(length=128), nullable=False),
    sa.Column('run_id', sa.BigInteger(), nullable=False),
    sa.Column('assignee', sa.String(length=64), nullable=True),
    sa.Column('outcome', sa.String(length=16), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('ended_at', sa.Float(), nullable=True),
    sa.CheckConstraint("outcome IN ('running', 'done', 'blocked', 'cancelled', 'moved')", name=op.f('ck_runs_outcome')),
    sa.PrimaryKeyConstraint('board', 'task_id', 'run_id', name=op.f('pk_runs'))
    )
    op.create_table('tasks',
    sa.Column('board', sa.String(length=64), nullable=False),
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('title', sa.Text(), nullable=False),
    sa.Column('body', sa.Text(), server_default='', nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('assignee', sa.String(length=64), nullable=True),
    sa.Column('current_run_id', sa.BigInteger(), nullable=True),
    sa.Column('lane', sa.String(length=64), nullable=False),
    sa.Column('block_reason', sa.Text(), nullable=True),
    sa.Column('block_kind', sa.String(length=32), nullable=True),
    sa.Column('result', sa.Text(), nullable=True),
    sa.Column('created_at', sa.Float(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.CheckConstraint("status <> 'running' OR current_run_id IS NOT NULL", name=op.f('ck_tasks_running_has_run')),
    sa.CheckConstraint("status IN ('ready', 'running', 'blocked', 'done')", name=op.f('ck_tasks_status')),
    sa.ForeignKeyConstraint(['board'], ['boards.name'], name='fk_tasks_board'),
    sa.PrimaryKeyConstraint('board', 'id', name=op.f('pk_tasks'))
    )
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.create_index('ix_tasks_board_status', ['board', 'status'], unique=False)
        batch_op.create_index('ix_tasks_status_lane', ['status', 'lane', 'created_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_index('ix_tasks_status_lane')
        batch_op.drop_index('ix_tasks_board_status')

    op.drop_table('tasks')
    op.drop_table('runs')
    op.drop_table('boards')

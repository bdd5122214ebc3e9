"""a task says when it last turned ready (ready_at), where its claim's wait starts

A task that is ready now turned ready when it was last updated (only an add or an unblock
leaves a task ready), so those are filled in; for any other task it is not known: null.

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


def upgrade() -> None:
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.add_column(sa.Column('ready_at', sa.Float(), nullable=True))
    op.execute("UPDATE tasks SET ready_at = updated_at WHERE status = 'ready'")


def downgrade() -> None:
    with op.batch_alter_table('tasks', schema=None) as batch_op:
        batch_op.drop_column('ready_at')

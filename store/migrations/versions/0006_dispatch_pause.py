"""dispatch pause: one row saying whether dispatch is paused, and why; pause and resume audit events

Revision ID: 0006
Revises: 0005
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KINDS = (
    'claim', 'grant', 'expiry', 'result', 'release', 'settle', 'requeue',
    'abandon', 'cancel', 'failure', 'quarantine', 'children_retired',
)
NEW_KINDS = ('pause', 'resume')


def _kinds(kinds: tuple[str, ...]) -> str:
    return 'kind IN (' + ', '.join(f"'{k}'" for k in kinds) + ')'


def upgrade() -> None:
    pause = op.create_table('dispatch_pause',
    sa.Column('id', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('paused', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('actor', sa.String(length=64), nullable=True),
    sa.Column('since', sa.Float(), nullable=True),
    sa.CheckConstraint('id = 1', name=op.f('ck_dispatch_pause_single_row')),
    sa.CheckConstraint('NOT paused OR (reason IS NOT NULL AND since IS NOT NULL)', name=op.f('ck_dispatch_pause_paused_has_reason')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_dispatch_pause')),
    )
    op.bulk_insert(pause, [{"id": 1, "paused": False}])
    # SQLite cannot alter a CHECK: batch mode copies the table (its index comes along)
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_audit_events_kind'), type_='check')
        batch_op.create_check_constraint(op.f('ck_audit_events_kind'), _kinds(KINDS + NEW_KINDS))


def downgrade() -> None:
    op.execute("DELETE FROM audit_events WHERE kind IN ('pause', 'resume')")
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.drop_constraint(op.f('ck_audit_events_kind'), type_='check')
        batch_op.create_check_constraint(op.f('ck_audit_events_kind'), _kinds(KINDS))
    op.drop_table('dispatch_pause')

"""Tables of the built-in Kanban board: boards, tasks, and one run per claim."""

from __future__ import annotations

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    Float,
    ForeignKeyConstraint,
    Index,
    MetaData,
    String,
    Table,
    Text,
    false,
)

from board.protocol import TaskStatus
from core import shapes

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)
_STATUSES = ", ".join(f"'{s.value}'" for s in TaskStatus)

boards = Table(
    "boards",
    metadata,
    Column("name", String(shapes.BOARD_CHARS), primary_key=True),
    Column("archived", Boolean, nullable=False, server_default=false()),
    Column("created_at", Float, nullable=False),
)

tasks = Table(
    "tasks",
    metadata,
    Column("board", String(shapes.BOARD_CHARS), primary_key=True),
    Column("id", String(shapes.TASK_ID_CHARS), primary_key=True),
    Column("title", Text, nullable=False),
    Column("body", Text, nullable=False, server_default=""),
    Column("status", String(16), nullable=False),
    Column("assignee", String(shapes.ASSIGNEE_CHARS)),
    Column("current_run_id", BigInteger),
    Column("lane", String(shapes.LANE_CHARS), nullable=False),
    Column("block_reason", Text),
    Column("block_kind", String(shapes.BLOCK_KIND_CHARS)),
    Column("result", Text),
    # When the task last turned ready (added, unblocked, reassigned): where a claim's wait starts.
    # Null for a task that was not ready when the column came (migration 0003).
    Column("ready_at", Float),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    ForeignKeyConstraint(["board"], ["boards.name"], name="fk_tasks_board"),
    CheckConstraint(f"status IN ({_STATUSES})", name="status"),
    CheckConstraint("status <> 'running' OR current_run_id IS NOT NULL", name="running_has_run"),
    Index("ix_tasks_board_status", "board", "status"),
    Index("ix_tasks_status_lane", "status", "lane", "created_at"),
)

runs = Table(
    "runs",
    metadata,
    Column("board", String(shapes.BOARD_CHARS), primary_key=True),
    Column("task_id", String(shapes.TASK_ID_CHARS), primary_key=True),
    Column("run_id", BigInteger, primary_key=True),
    Column("assignee", String(shapes.ASSIGNEE_CHARS)),
    Column("outcome", String(16), nullable=False),
    Column("started_at", Float, nullable=False),
    Column("ended_at", Float),
    CheckConstraint("outcome IN ('running', 'done', 'blocked', 'cancelled', 'moved')", name="outcome"),
)

# A claim request id -> the claims it made (JSON), so a retried claim returns them and claims nothing
# more (``KanbanBoard.claim_ready``'s ``request_id``; the board server's /v1/claims). Rows older than
# ``board.kanban.CLAIM_MEMORY_SECONDS`` are pruned by later claims.
claim_requests = Table(
    "claim_requests",
    metadata,
    Column("request_id", String(shapes.REQUEST_ID_CHARS), primary_key=True),
    Column("claims", Text, nullable=False),
    Column("created_at", Float, nullable=False),
    Index("ix_claim_requests_created_at", "created_at"),
)

# What board migration 0004 makes in each dialect's own DDL, outside ``metadata``, for
# ``KanbanBoard.search_tasks``: SQLite's FTS5 table (and the shadow tables FTS5 names after it),
# PostgreSQL's trigram and created_at indexes.
SEARCH_INDEX = ("tasks_search", "ix_tasks_title_trgm", "ix_tasks_body_trgm", "ix_tasks_created_at")

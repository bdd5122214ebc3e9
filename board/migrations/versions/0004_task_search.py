"""an index to search tasks' titles and bodies by any piece of 3 characters or more

SQLite: an FTS5 table of trigrams over ``tasks`` (external content: it keeps no copy
of the text), kept in step by triggers, so every writer of the board's database (the
Kanban, another process, a hand-written INSERT) feeds it. PostgreSQL: ``pg_trgm``'s GIN
indexes on ``title`` and ``body``, which serve ``ILIKE '%text%'``, and one on
``created_at`` for "newest first". Both answer "holds
this text, any case", the substring search the console already does with LIKE
(docs/operate.md, `board search`). Other databases get no index (the Kanban then says
it cannot search).

Revision ID: 0004
Revises: 0003
"""

from collections.abc import Sequence

from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SQLITE_UP = [
    "CREATE VIRTUAL TABLE tasks_search USING fts5("
    "title, body, content='tasks', content_rowid='rowid', tokenize='trigram')",
    "CREATE TRIGGER tasks_search_insert AFTER INSERT ON tasks BEGIN"
    " INSERT INTO tasks_search(rowid, title, body) VALUES (new.rowid, new.title, new.body); END",
    "CREATE TRIGGER tasks_search_delete AFTER DELETE ON tasks BEGIN"
    " INSERT INTO tasks_search(tasks_search, rowid, title, body)"
    " VALUES ('delete', old.rowid, old.title, old.body); END",
    "CREATE TRIGGER tasks_search_update AFTER UPDATE OF title, body ON tasks BEGIN"
    " INSERT INTO tasks_search(tasks_search, rowid, title, body)"
    " VALUES ('delete', old.rowid, old.title, old.body);"
    " INSERT INTO tasks_search(rowid, title, body) VALUES (new.rowid, new.title, new.body); END",
    "INSERT INTO tasks_search(tasks_search) VALUES ('rebuild')",  # the tasks already there
]
POSTGRESQL_UP = [
    "CREATE EXTENSION IF NOT EXISTS pg_trgm",
    "CREATE INDEX ix_tasks_title_trgm ON tasks USING gin (title gin_trgm_ops)",
    "CREATE INDEX ix_tasks_body_trgm ON tasks USING gin (body gin_trgm_ops)",
    # Newest first without sorting every match: for text most tasks hold, the planner walks this
    # backwards and stops at the limit (SQLite's FTS5 reads its rowids backwards to the same end).
    "CREATE INDEX ix_tasks_created_at ON tasks (created_at)",
]
SQLITE_DOWN = [
    "DROP TRIGGER tasks_search_update",
    "DROP TRIGGER tasks_search_delete",
    "DROP TRIGGER tasks_search_insert",
    "DROP TABLE tasks_search",
]
POSTGRESQL_DOWN = ["DROP INDEX ix_tasks_created_at", "DROP INDEX ix_tasks_body_trgm", "DROP INDEX ix_tasks_title_trgm"]


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    for statement in {"sqlite": SQLITE_UP, "postgresql": POSTGRESQL_UP}.get(dialect, []):
        op.execute(statement)


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    for statement in {"sqlite": SQLITE_DOWN, "postgresql": POSTGRESQL_DOWN}.get(dialect, []):
        op.execute(statement)

"""States live in the schema: enum and CHECK agree, migrations match the models and are idempotent."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine, inspect, text

from board import Board, open_board
from board.schema import SEARCH_INDEX
from board.schema import metadata as board_metadata
from core import db
from core.errors import ConfigError, Unavailable
from core.settings import Settings
from poolkeeper.embedded import free_port
from store import PoolStore
from store.models import ChildOutcome, ChildStatus, RowState
from store.models import metadata as store_metadata


def test_state_check_in_the_database_lists_exactly_the_enum(store: PoolStore) -> None:
    checks = inspect(store.engine).get_check_constraints("assignments")
    state_check = next(c["sqltext"] for c in checks if c["name"] == "ck_assignments_state")
    assert set(re.findall(r"'(\w+)'", state_check)) == {s.value for s in RowState}


def test_child_status_and_outcome_checks_list_exactly_the_enums(store: PoolStore) -> None:
    checks = inspect(store.engine).get_check_constraints("child_executions")
    listed = {c["name"]: set(re.findall(r"'(\w+)'", c["sqltext"])) for c in checks}
    assert listed["ck_child_executions_status"] == {s.value for s in ChildStatus}
    assert listed["ck_child_executions_outcome"] == {o.value for o in ChildOutcome}


@pytest.mark.parametrize("which", ["store", "board"])
def test_migrations_match_the_models_and_rerun_as_noop(
    store: PoolStore, kanban: Board, engine_of: Callable[[Board], Engine], which: str
) -> None:
    if which == "store":
        engine, metadata = store.engine, store_metadata
    else:
        engine, metadata = engine_of(kanban), board_metadata
    (store.migrate if which == "store" else kanban.migrate)()  # second run: nothing to do
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"version_table": f"{which}_alembic_version"})
        foreign = _other_tables(which) | {"store_alembic_version", "board_alembic_version"}
        diff = [
            d
            for d in compare_metadata(ctx, metadata)
            if _table_of(d) not in foreign and not _name_of(d).startswith(SEARCH_INDEX)
        ]
        assert diff == []
        assert conn.execute(text(f"SELECT count(*) FROM {which}_alembic_version")).scalar() == 1


def _table_of(diff: object) -> str:
    """The table an autogenerate diff entry is about (the shared database holds both schemas)."""
    obj = diff[1] if isinstance(diff, tuple) else None
    table = getattr(obj, "table", obj)
    return str(getattr(table, "name", ""))


def _name_of(diff: object) -> str:
    """The name of the table or index a diff entry adds or removes."""
    obj = diff[1] if isinstance(diff, tuple) else None
    return str(getattr(obj, "name", ""))


def _other_tables(which: str) -> set[str]:
    other = board_metadata if which == "store" else store_metadata
    return set(other.tables)


def test_database_refuses_a_second_live_row_on_an_ordinal(store: PoolStore) -> None:
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={}, now=0)
    with pytest.raises(Exception, match=r"(?i)unique|duplicate"), store.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO assignments (board, task_id, run_id, ordinal, state, attempt, payload,"
                " payload_digest, created_at, updated_at, failures, next_attempt_at, quarantined)"
                " VALUES ('b', 't2', 1, 0, 'assigned', 1, '{}', 'x', 0, 0, 0, 0, false)"
            )
        )


def test_scanner_indexes_exist(store: PoolStore) -> None:
    names = {ix["name"] for ix in inspect(store.engine).get_indexes("assignments")}
    assert {
        "ux_assignments_live_ordinal",
        "ix_assignments_running_lease",
        "ix_assignments_state_due",
        "ix_assignments_terminal_age",
    } <= names


def test_require_schema_refuses_a_database_without_schema_or_behind_head(settings: Settings) -> None:
    store, kanban = PoolStore.from_settings(settings), open_board(settings)
    with store.engine.connect() as conn:  # given a database that exists but holds no schema
        conn.execute(text("CREATE TABLE unrelated (x INTEGER)"))
        conn.commit()
    try:
        for target, what in ((store, "pool store"), (kanban, "board")):
            with pytest.raises(ConfigError, match=rf"^no {what} at .*: run `poolctl init`"):
                target.require_schema()
        store.migrate()
        store.require_schema()  # migrated: ready; the board (same database here) is still not
        with pytest.raises(ConfigError, match="no board at"):
            kanban.require_schema()
        with store.engine.begin() as conn:
            conn.execute(text("UPDATE store_alembic_version SET version_num = 'old'"))
        with pytest.raises(ConfigError, match=r"not migrated \(at old, head \d+\): run `poolctl init`"):
            store.require_schema()
    finally:
        with store.engine.begin() as conn:
            conn.execute(text("DROP TABLE unrelated"))
        store.engine.dispose()
        kanban.close()


@pytest.mark.parametrize("package", ["store", "board"])
def test_the_heads_read_from_the_scripts_are_alembics(package: str) -> None:
    """``require_schema`` parses the scripts instead of importing alembic: the same heads."""
    scripts = ScriptDirectory.from_config(db._alembic_config(package))
    assert db._heads(package) == frozenset(scripts.get_heads())


def test_require_schema_creates_no_missing_file_and_names_a_dead_server(tmp_path: Path) -> None:
    missing = tmp_path / "nothing-here.db"
    with pytest.raises(ConfigError, match="no pool store at"):
        PoolStore(f"sqlite:///{missing}").require_schema()
    assert not missing.exists()
    with pytest.raises(Unavailable, match="pool store"):
        PoolStore(f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/x").require_schema()

"""What only the built-in Kanban does: operator moves, its SQLite locking, the chaos wrapper.

The ``Board`` protocol itself is tested for every backend in ``test_board_contract.py``.
"""

from __future__ import annotations

import sqlite3
from typing import Any

import pytest
from sqlalchemy import event

from board import FlakyBoard, KanbanBoard, TaskStatus
from board.faults import PoisonedTask
from core.errors import InvalidInput, NotFound, TransientError
from core.settings import Settings


def test_operator_moves_name_what_was_wrong(kanban: KanbanBoard) -> None:
    kanban.add_task("b", "x", task_id="t1")
    with pytest.raises(NotFound, match="b/nope"):
        kanban.cancel_task("b", "nope")
    with pytest.raises(InvalidInput, match="status: b/t1 is ready"):
        kanban.unblock_task("b", "t1")
    with pytest.raises(InvalidInput, match="task_id"):
        kanban.add_task("b", "dup", task_id="t1")
    with pytest.raises(InvalidInput, match="board"):
        kanban.add_task("b'; DROP TABLE tasks; --", "x")
    assert [t.id for t in kanban.list_tasks()] == ["t1"]


def test_locked_board_database_is_a_transient_error(tmp_path: object) -> None:
    path = f"{tmp_path}/board.db"
    kanban = KanbanBoard(f"sqlite:///{path}")
    kanban.migrate()
    kanban.add_task("b", "x", task_id="t1")
    blocker = sqlite3.connect(path, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        kanban.engine.dispose()
        from sqlalchemy import event

        @event.listens_for(kanban.engine, "connect")
        def short_timeout(conn: sqlite3.Connection, _rec: object) -> None:
            conn.execute("PRAGMA busy_timeout=50")

        with pytest.raises(TransientError, match="board"):
            kanban.claim_ready(1, assignee="pool", lane="pool")
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    assert len(kanban.claim_ready(1, assignee="pool", lane="pool")) == 1


def test_flaky_board_fails_poisoned_tasks_every_time(kanban: KanbanBoard) -> None:
    kanban.add_task("b", "x", task_id="bad")
    flaky = FlakyBoard(kanban, poison=frozenset({"bad"}))
    for _ in range(3):
        with pytest.raises(PoisonedTask, match="bad"):
            flaky.get_task("b", "bad")
    assert flaky.list_boards() == ["b"]


def test_an_operator_move_that_lost_a_race_changes_nothing(settings: Settings, kanban: KanbanBoard) -> None:
    """Between the move's read and its guarded write another writer moves the task: refused, not blind."""
    if not settings.board_url.startswith("postgresql"):
        pytest.skip("SQLite's BEGIN IMMEDIATE already keeps every other writer out of the move")
    kanban.add_task("b", "x", task_id="t1")
    kanban.claim_ready(1, assignee="pool", lane="pool")
    other = KanbanBoard(settings.board_url)
    fired: list[bool] = []

    @event.listens_for(kanban.engine, "before_cursor_execute")
    def sneak_in(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.startswith("UPDATE tasks") and not fired:
            fired.append(True)
            assert other.complete_task("b", "t1", 1, {"status": "done"})

    with pytest.raises(TransientError, match="changed concurrently"):
        kanban.reassign_task("b", "t1", assignee="alice", lane="humans")
    event.remove(kanban.engine, "before_cursor_execute", sneak_in)
    assert fired, "the other writer got in"
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.DONE and task.lane == "pool"
    other.engine.dispose()

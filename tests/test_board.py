"""The built-in Kanban board: atomic claims, compare-and-set on the exact run, operator moves."""

from __future__ import annotations

import sqlite3

import pytest

from board import FlakyBoard, KanbanBoard, TaskStatus
from board.faults import PoisonedTask
from poolkeeper.errors import InvalidInput, NotFound, TransientError


def claim(kanban: KanbanBoard, limit: int = 10) -> list[tuple[str, str, int]]:
    return [(c.board, c.task_id, c.run_id) for c in kanban.claim_ready(limit, assignee="pool", lane="pool")]


def test_claim_takes_only_ready_pool_lane_tasks_oldest_first(kanban: KanbanBoard) -> None:
    kanban.add_task("b", "first", task_id="t1")
    kanban.add_task("b", "other lane", task_id="t2", lane="humans")
    kanban.add_task("b", "second", task_id="t3")
    assert claim(kanban, 1) == [("b", "t1", 1)]
    assert claim(kanban) == [("b", "t3", 1)]
    assert claim(kanban) == []
    running = {t.id: t for t in kanban.running_tasks("b")}
    assert set(running) == {"t1", "t3"} and running["t1"].assignee == "pool"


def test_archived_boards_are_not_claimed_or_listed(kanban: KanbanBoard) -> None:
    kanban.add_task("old", "x", task_id="t1")
    kanban.archive_board("old")
    assert claim(kanban) == []
    assert kanban.list_boards() == [] and kanban.list_boards(include_archived=True) == ["old"]


def test_complete_and_block_act_on_the_exact_run_only(kanban: KanbanBoard) -> None:
    kanban.add_task("b", "x", task_id="t1")
    [(_, _, run)] = claim(kanban)
    assert not kanban.complete_task("b", "t1", run + 1, {"status": "done"})
    assert kanban.complete_task("b", "t1", run, {"status": "done"})
    assert not kanban.block_task("b", "t1", "late", "transient", run)  # no longer running
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.DONE and task.result == {"status": "done"}


def test_unblocked_task_is_claimed_again_with_a_new_run_id(kanban: KanbanBoard) -> None:
    kanban.add_task("b", "x", task_id="t1")
    [(_, _, run)] = claim(kanban)
    assert kanban.block_task("b", "t1", "lease expired", "transient", run)
    blocked = kanban.get_task("b", "t1")
    assert blocked is not None and (blocked.block_reason, blocked.block_kind) == (
        "lease expired",
        "transient",
    )
    kanban.unblock_task("b", "t1")
    assert claim(kanban) == [("b", "t1", run + 1)]


def test_reassign_moves_the_run_on_and_cancel_ends_the_task(kanban: KanbanBoard) -> None:
    kanban.add_task("b", "x", task_id="t1")
    [(_, _, run)] = claim(kanban)
    moved = kanban.reassign_task("b", "t1", assignee="alice", lane="humans")
    assert moved.current_run_id == run + 1 and moved.status is TaskStatus.RUNNING
    assert not kanban.complete_task("b", "t1", run, {"status": "done"})
    cancelled = kanban.cancel_task("b", "t1")
    assert cancelled.status is TaskStatus.DONE and cancelled.result == {"cancelled": True}


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

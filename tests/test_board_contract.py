"""The ``Board`` protocol's contract, run against every backend (today: Kanban on SQLite and PostgreSQL).

A second backend gets the whole suite by adding one entry to ``BACKENDS``: a
factory from the settings to an object that is a ``Board`` and can be seeded
with the few operator moves the tests need (``Seedable``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pytest

from board import Board, BoardTask, KanbanBoard, TaskStatus
from core.settings import Settings


class Seedable(Board, Protocol):
    def add_task(
        self, board: str, title: str, body: str = "", *, lane: str = "pool", task_id: str | None = None
    ) -> str: ...

    def archive_board(self, board: str) -> None: ...

    def unblock_task(self, board: str, task_id: str) -> BoardTask: ...

    def reassign_task(self, board: str, task_id: str, *, assignee: str, lane: str) -> BoardTask: ...

    def cancel_task(self, board: str, task_id: str) -> BoardTask: ...

    def delete_task(self, board: str, task_id: str) -> None: ...


def _kanban(settings: Settings) -> Any:
    kanban = KanbanBoard(settings.board_url)
    kanban.migrate()
    return kanban


BACKENDS: dict[str, Callable[[Settings], Seedable]] = {"kanban": _kanban}


@pytest.fixture(params=sorted(BACKENDS))
def kanban(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Seedable]:
    """The board under test (named as the Kanban fixture it stands in for)."""
    yield BACKENDS[request.param](settings)


def claim(kanban: Board, limit: int = 10) -> list[tuple[str, str, int]]:
    return [(c.board, c.task_id, c.run_id) for c in kanban.claim_ready(limit, assignee="pool", lane="pool")]


def test_claim_takes_only_ready_pool_lane_tasks_oldest_first(kanban: Seedable) -> None:
    kanban.add_task("b", "first", task_id="t1")
    kanban.add_task("b", "other lane", task_id="t2", lane="humans")
    kanban.add_task("b", "second", task_id="t3")
    assert claim(kanban, 1) == [("b", "t1", 1)]
    assert claim(kanban) == [("b", "t3", 1)]
    assert claim(kanban) == []
    running = {t.id: t for t in kanban.running_tasks("b")}
    assert set(running) == {"t1", "t3"} and running["t1"].assignee == "pool"


def test_archived_boards_are_not_claimed_or_listed(kanban: Seedable) -> None:
    kanban.add_task("old", "x", task_id="t1")
    kanban.archive_board("old")
    assert claim(kanban) == []
    assert kanban.list_boards() == [] and kanban.list_boards(include_archived=True) == ["old"]


def test_complete_and_block_act_on_the_exact_run_only(kanban: Seedable) -> None:
    kanban.add_task("b", "x", task_id="t1")
    [(_, _, run)] = claim(kanban)
    assert not kanban.complete_task("b", "t1", run + 1, {"status": "done"})
    assert kanban.complete_task("b", "t1", run, {"status": "done"})
    assert not kanban.block_task("b", "t1", "late", "transient", run)  # no longer running
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.DONE and task.result == {"status": "done"}


def test_unblocked_task_is_claimed_again_with_a_new_run_id(kanban: Seedable) -> None:
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


def test_run_ids_never_repeat_for_a_task_id_even_after_delete(kanban: Seedable) -> None:
    kanban.add_task("b", "x", task_id="t1")
    [(_, _, first)] = claim(kanban)
    kanban.reassign_task("b", "t1", assignee="alice", lane="humans")  # run first + 1
    kanban.delete_task("b", "t1")
    kanban.add_task("b", "x again", task_id="t1")
    kanban.add_task("b", "other", task_id="t2")
    assert claim(kanban) == [("b", "t1", first + 2), ("b", "t2", 1)]
    kanban.delete_task("b", "t1")
    kanban.add_task("b", "third time", task_id="t1")
    assert claim(kanban) == [("b", "t1", first + 3)]


def test_reassign_moves_the_run_on_and_cancel_ends_the_task(kanban: Seedable) -> None:
    kanban.add_task("b", "x", task_id="t1")
    [(_, _, run)] = claim(kanban)
    moved = kanban.reassign_task("b", "t1", assignee="alice", lane="humans")
    assert moved.current_run_id == run + 1 and moved.status is TaskStatus.RUNNING
    assert not kanban.complete_task("b", "t1", run, {"status": "done"})
    cancelled = kanban.cancel_task("b", "t1")
    assert cancelled.status is TaskStatus.DONE and cancelled.result == {"cancelled": True}


def test_an_unknown_task_is_none_and_an_unknown_board_runs_nothing(kanban: Seedable) -> None:
    assert kanban.get_task("nowhere", "t1") is None
    assert kanban.running_tasks("nowhere") == []
    assert not kanban.complete_task("nowhere", "t1", 1, {"status": "done"})

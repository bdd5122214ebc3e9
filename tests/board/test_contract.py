"""The ``Board`` protocol's contract, run against every backend (today: Kanban on SQLite and PostgreSQL).

A second backend gets the whole suite by adding one entry to ``BACKENDS``: a
factory from the settings to a fresh, migrated ``Board``. The suite uses the
protocol's calls only: the plane's, the operator moves and the reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from board import Board, TaskStatus, open_board
from core.errors import ConfigError, InvalidInput, NotFound
from core.settings import Settings


def _kanban(settings: Settings) -> Board:
    kanban = open_board(settings)
    kanban.migrate()
    return kanban


BACKENDS: dict[str, Callable[[Settings], Board]] = {"kanban": _kanban}


@pytest.fixture(params=sorted(BACKENDS))
def kanban(request: pytest.FixtureRequest, settings: Settings) -> Iterator[Board]:
    """The board under test (named as the Kanban fixture it stands in for)."""
    board = BACKENDS[request.param](settings)
    yield board
    board.close()


def claim(kanban: Board, limit: int = 10) -> list[tuple[str, str, int]]:
    return [(c.board, c.task_id, c.run_id) for c in kanban.claim_ready(limit, assignee="pool", lane="pool")]


def test_claim_takes_only_ready_pool_lane_tasks_oldest_first(kanban: Board) -> None:
    kanban.add_task("b", "first", task_id="t1")
    kanban.add_task("b", "other lane", task_id="t2", lane="humans")
    kanban.add_task("b", "second", task_id="t3")
    assert claim(kanban, 1) == [("b", "t1", 1)]
    assert claim(kanban) == [("b", "t3", 1)]
    assert claim(kanban) == []
    running = {t.id: t for t in kanban.running_tasks("b")}
    assert set(running) == {"t1", "t3"} and running["t1"].assignee == "pool"


def test_archived_boards_are_not_claimed_or_listed(kanban: Board) -> None:
    kanban.add_task("old", "x", task_id="t1")
    kanban.archive_board("old")
    assert claim(kanban) == []
    assert kanban.list_boards() == [] and kanban.list_boards(include_archived=True) == ["old"]


def test_complete_and_block_act_on_the_exact_run_only(kanban: Board) -> None:
    kanban.add_task("b", "x", task_id="t1")
    [(_, _, run)] = claim(kanban)
    assert not kanban.complete_task("b", "t1", run + 1, {"status": "done"})
    assert kanban.complete_task("b", "t1", run, {"status": "done"})
    assert not kanban.block_task("b", "t1", "late", "transient", run)  # no longer running
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.DONE and task.result == {"status": "done"}


def test_unblocked_task_is_claimed_again_with_a_new_run_id(kanban: Board) -> None:
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


def test_run_ids_never_repeat_for_a_task_id_even_after_delete(kanban: Board) -> None:
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


def test_reassign_moves_the_run_on_and_cancel_ends_the_task(kanban: Board) -> None:
    kanban.add_task("b", "x", task_id="t1")
    [(_, _, run)] = claim(kanban)
    moved = kanban.reassign_task("b", "t1", assignee="alice", lane="humans")
    assert moved.current_run_id == run + 1 and moved.status is TaskStatus.RUNNING
    assert not kanban.complete_task("b", "t1", run, {"status": "done"})
    cancelled = kanban.cancel_task("b", "t1")
    assert cancelled.status is TaskStatus.DONE and cancelled.result == {"cancelled": True}


def test_an_unknown_task_is_none_and_an_unknown_board_runs_nothing(kanban: Board) -> None:
    assert kanban.get_task("nowhere", "t1") is None
    assert kanban.running_tasks("nowhere") == []
    assert not kanban.complete_task("nowhere", "t1", 1, {"status": "done"})


def test_a_migrated_board_is_ready_and_says_where_it_is(kanban: Board) -> None:
    kanban.migrate()  # again: a no-op
    kanban.require_schema(writable=True)
    kanban.require_creatable()
    assert kanban.location()
    kanban.close()
    assert kanban.list_boards() == []  # usable again after close


def test_an_unmigrated_board_is_refused_before_anything_is_created(settings: Settings) -> None:
    board = open_board(settings)
    try:
        with pytest.raises(ConfigError, match="poolctl init"):
            board.require_schema()
    finally:
        board.close()


def test_added_tasks_are_listed_counted_and_their_boards_known(kanban: Board) -> None:
    kanban.add_task("b", "first", "body", task_id="t1")
    generated = kanban.add_task("b", "second")
    kanban.add_task("c", "elsewhere", task_id="t1", lane="humans")
    assert kanban.has_board("b") and kanban.has_board("c") and not kanban.has_board("nowhere")
    assert [(t.board, t.id) for t in kanban.list_tasks("b")] == [("b", "t1"), ("b", generated)]
    [first] = kanban.list_tasks("b", limit=1)
    assert (first.title, first.body, first.status, first.lane) == ("first", "body", TaskStatus.READY, "pool")
    claim(kanban, 1)
    assert [t.id for t in kanban.list_tasks(status=TaskStatus.RUNNING)] == ["t1"]
    assert kanban.counts_by_status() == {"ready": 2, "running": 1, "blocked": 0, "done": 0}
    with pytest.raises(InvalidInput, match="task_id"):
        kanban.add_task("b", "again", task_id="t1")


def test_runs_are_kept_per_task_with_their_outcomes(kanban: Board) -> None:
    kanban.add_task("b", "x", task_id="t1")
    kanban.add_task("b", "y", task_id="t2")
    [(_, _, r1), (_, _, r2)] = claim(kanban)
    assert kanban.block_task("b", "t1", "lease expired", "transient", r1)
    assert kanban.complete_task("b", "t2", r2, {"status": "done"})
    kanban.unblock_task("b", "t1")
    [(_, _, r3)] = claim(kanban)
    assert sorted(kanban.pool_runs("pool")) == [
        ("b", "t1", r1, "blocked"),
        ("b", "t1", r3, "running"),
        ("b", "t2", r2, "done"),
    ]
    runs = kanban.list_runs("b", ["t1"])
    assert [(r["task_id"], r["run_id"], r["assignee"], r["outcome"]) for r in runs] == [
        ("t1", r1, "pool", "blocked"),
        ("t1", r3, "pool", "running"),
    ]
    assert kanban.list_runs("b", []) == []


def test_an_operator_move_the_status_does_not_allow_is_refused(kanban: Board) -> None:
    kanban.add_task("b", "x", task_id="t1")
    with pytest.raises(InvalidInput, match="status"):
        kanban.unblock_task("b", "t1")  # ready, not blocked
    with pytest.raises(InvalidInput, match="status"):
        kanban.reassign_task("b", "t1", assignee="alice", lane="humans")  # not running
    kanban.cancel_task("b", "t1")
    with pytest.raises(InvalidInput, match="status"):
        kanban.cancel_task("b", "t1")  # already done
    for move in (kanban.unblock_task, kanban.cancel_task, kanban.delete_task):
        with pytest.raises(NotFound):
            move("b", "nosuch")
    with pytest.raises(NotFound):
        kanban.archive_board("nowhere")

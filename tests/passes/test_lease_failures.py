"""Lease failures: the exact run is parked on the board, or settled on its evidence, then finalized."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from board import Board, FlakyBoard, TaskStatus
from core.errors import TransientError
from tasks import runner
from tasks.plane import Plane
from tests.factories import NOW, lease_failed_row, row_state


def test_lease_failure_parks_the_exact_run_then_finalizes(plane: Plane, kanban: Board) -> None:
    row = lease_failed_row(plane, kanban)
    assert runner.run_key(plane, "lease_failures", row, NOW) == "finalized"
    task = kanban.get_task("b", "b0")
    assert task is not None and task.status is TaskStatus.BLOCKED
    assert (task.block_kind, task.block_reason) == ("transient", "lease expired after 3 fenced attempts")


@pytest.mark.parametrize(
    ("board_move", "expected"),
    [
        ("delete", "stale"),
        ("reassign", "stale"),
        ("cancel", "finalized"),
    ],
)
def test_lease_failure_settles_on_the_boards_evidence(
    plane: Plane, kanban: Board, board_move: str, expected: str
) -> None:
    row = lease_failed_row(plane, kanban)
    moves: dict[str, Callable[[], object]] = {
        "delete": lambda: kanban.delete_task("b", "b0"),
        "reassign": lambda: kanban.reassign_task("b", "b0", assignee="bob", lane="pool"),
        "cancel": lambda: kanban.cancel_task("b", "b0"),
    }
    moves[board_move]()
    assert runner.run_key(plane, "lease_failures", row, NOW) == expected
    assert row_state(plane.store, row)["state"] == expected


def test_busy_board_keeps_the_row_lease_failed_and_never_collected(plane: Plane, kanban: Board) -> None:
    row = lease_failed_row(plane, kanban)
    plane.board = FlakyBoard(kanban, busy_rate=0.999999)
    with pytest.raises(TransientError):
        runner.run_key(plane, "lease_failures", row, NOW)
    runner.run_key(plane, "gc", "all", NOW + 10 * plane.settings.retention_seconds)
    assert row_state(plane.store, row)["state"] == "lease_failed"
    plane.board = kanban  # the board answers again
    assert runner.run_key(plane, "lease_failures", row, NOW) == "finalized"

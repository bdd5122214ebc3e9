"""The board (source of truth): the ``Board`` protocol and the built-in Kanban."""

from __future__ import annotations

from board.faults import FlakyBoard
from board.kanban import KanbanBoard
from board.protocol import Board, BoardTask, Claim, TaskStatus
from core.settings import Settings

__all__ = ["Board", "BoardTask", "Claim", "FlakyBoard", "KanbanBoard", "TaskStatus", "open_board"]


def open_board(settings: Settings, kanban: KanbanBoard | None = None) -> Board:
    """The board the maintenance plane talks to, with chaos faults when configured."""
    board = kanban or KanbanBoard(settings.board_url)
    if settings.chaos_board_busy_rate or settings.poison_tasks:
        return FlakyBoard(board, busy_rate=settings.chaos_board_busy_rate, poison=settings.poison_tasks)
    return board

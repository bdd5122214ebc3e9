"""The board (source of truth): the ``Board`` protocol, and ``open_board`` to get one.

``open_board`` is the one place that knows the backends: ``POOL_BOARD_URL``'s
scheme picks one (``BACKENDS``). Nothing outside ``board/`` names a backend's
class (``tests/test_architecture.py`` checks). ``with_faults`` adds the chaos
faults the settings ask for (``board.faults``), for the maintenance plane.
"""

from __future__ import annotations

from collections.abc import Callable

from board.faults import FlakyBoard
from board.http import open_http
from board.kanban import KanbanBoard
from board.protocol import Board, BoardTask, Claim, TaskStatus
from core.errors import UnusableURL
from core.settings import Settings, check_database_url

__all__ = [
    "Board",
    "BoardTask",
    "Claim",
    "FlakyBoard",
    "TaskStatus",
    "open_board",
    "with_faults",
]

# The URL scheme (before any "+driver") -> the backend that serves it.
BACKENDS: dict[str, Callable[[str], Board]] = {
    "sqlite": KanbanBoard,
    "postgresql": KanbanBoard,
    **dict.fromkeys(("http", "https"), lambda url: open_http(url, Settings.from_env())),  # until the registry
}


def open_board(settings: Settings) -> Board:
    """The board at ``POOL_BOARD_URL``; an unknown scheme is a ``ConfigError`` naming the known ones."""
    url = settings.board_url
    scheme, colon, _ = url.partition(":")
    backend = BACKENDS.get(scheme.partition("+")[0].lower()) if colon else None
    if backend is None:  # the URL is not echoed: it may hold a password
        known = ", ".join(f"{s}:" for s in sorted(BACKENDS))
        got = f"scheme {scheme + ':'!r}" if colon else "no scheme"
        raise UnusableURL(f"POOL_BOARD_URL: not a board URL of a known scheme ({known}); got {got}")
    if backend is KanbanBoard:
        check_database_url(url, "POOL_BOARD_URL")
    return backend(url)


def with_faults(board: Board, settings: Settings) -> Board:
    """``board`` with the chaos faults ``POOL_CHAOS_*`` ask for (the maintenance plane's calls only)."""
    if settings.chaos_board_busy_rate or settings.poison_tasks:
        return FlakyBoard(board, busy_rate=settings.chaos_board_busy_rate, poison=settings.poison_tasks)
    return board

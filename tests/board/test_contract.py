"""The ``Board`` contract kit (``poolkeeper.testing.board_contract``) over the built-in Kanban.

``settings`` (tests/conftest.py) runs it on a SQLite file and on PostgreSQL. A backend of the
project's own gets the whole kit by a class like this one: its ``open_handle``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy.engine import make_url

from board import Board, open_board
from core import db
from core.settings import Settings
from poolkeeper.testing.board_contract import BoardContract, Busy, sqlite_write_lock


class TestKanban(BoardContract):
    @pytest.fixture
    def open_handle(self, settings: Settings) -> Callable[[], Board]:
        return lambda: open_board(settings)

    @pytest.fixture
    def busy(self, settings: Settings, monkeypatch: pytest.MonkeyPatch) -> Busy | None:
        """Another connection holds the SQLite file's write lock (the Kanban waits 0.2 s, not 5, for it)."""
        path = make_url(settings.board_url).database
        if not settings.board_url.startswith("sqlite") or not path:
            return None  # PostgreSQL's writers wait for a lock rather than fail: no busy state to make
        monkeypatch.setattr(db, "SQLITE_BUSY_TIMEOUT_MS", 200)
        return sqlite_write_lock(path)

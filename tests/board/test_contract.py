"""The ``Board`` contract kit (``poolkeeper.testing.board_contract``) over the built-in Kanban.

``settings`` (tests/conftest.py) runs it on a SQLite file and on PostgreSQL. A backend of the
project's own gets the whole kit by a class like this one: its ``open_handle``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, event, text
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
    def busy(
        self,
        settings: Settings,
        board: Board,
        engine_of: Callable[[Board], Engine],
        monkeypatch: pytest.MonkeyPatch,
    ) -> Busy:
        """Another connection holds the board's write lock; the Kanban waits 0.2 s for it, not 5."""
        path = make_url(settings.board_url).database
        if settings.board_url.startswith("sqlite") and path:
            monkeypatch.setattr(db, "SQLITE_BUSY_TIMEOUT_MS", 200)
            return sqlite_write_lock(path)
        return tables_locked(settings.board_url, engine_of(board))


def tables_locked(url: str, engine: Engine) -> Busy:
    """A ``busy`` for the Kanban on PostgreSQL: its tables held in EXCLUSIVE mode by another connection.

    Readers still read; a writer waits ``lock_timeout`` (0.2 s on ``engine``'s new connections), then
    fails as a lock timeout does, which must reach the plane as ``TransientError``.
    """

    @event.listens_for(engine, "connect")
    def short_lock_wait(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.execute("SET lock_timeout = '200ms'")
        dbapi_connection.commit()  # a session setting, kept past the pool's rollback on check-in

    engine.dispose()  # the connections opened from now on wait 0.2 s

    @contextmanager
    def held() -> Iterator[None]:
        holder = create_engine(url)
        try:
            with holder.begin() as conn:
                conn.execute(text("LOCK TABLE boards, tasks, runs IN EXCLUSIVE MODE"))
                yield
        finally:
            holder.dispose()

    return held

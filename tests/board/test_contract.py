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


class Leaky:
    """The Kanban with one per-board call answering for every board: a backend the kit must fail."""

    def __init__(self, inner: Board, leaked: str) -> None:
        self.inner, self.leaked = inner, leaked

    def __getattr__(self, name: str) -> Any:
        if name != self.leaked:
            return getattr(self.inner, name)
        everywhere = self.inner.list_boards()
        if name == "running_tasks":
            return lambda board: [t for b in everywhere for t in self.inner.running_tasks(b)]
        if name == "get_task":
            return lambda board, task_id: next(
                t for b in everywhere if (t := self.inner.get_task(b, task_id)) is not None
            )
        if name == "list_tasks":
            return lambda board=None, status=None, limit=10_000: self.inner.list_tasks(None, status, limit)
        if name == "list_runs":
            return lambda board, task_ids: [r for b in everywhere for r in self.inner.list_runs(b, task_ids)]
        if name == "complete_task":  # settles the task of that id on whichever board runs that run
            return lambda board, task_id, run_id, result: any(
                self.inner.complete_task(b, task_id, run_id, result) for b in everywhere
            )
        raise AssertionError(f"no leak for {name}")


@pytest.mark.parametrize("leaked", ["running_tasks", "get_task", "list_tasks", "list_runs", "complete_task"])
def test_the_kit_fails_a_backend_whose_per_board_call_reaches_other_boards(
    settings: Settings, leaked: str
) -> None:
    board = open_board(settings)
    board.migrate()
    try:
        with pytest.raises(AssertionError):
            BoardContract().test_every_read_and_settle_is_scoped_to_its_board(Leaky(board, leaked))
    finally:
        board.close()

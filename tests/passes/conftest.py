"""The passes run twice: against the built-in Kanban directly, and over HTTP.

Over HTTP the plane's board is ``HttpBoard`` → the reference server (``poolctl board
serve``'s app, in a thread) → the same Kanban, so every pass's isolation and fault
test also holds across the network (issue 22). A test that writes past the ``Board``
API (``engine_of``) writes to the Kanban's database either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest
from sqlalchemy import Engine

from board import Board, open_board
from board.http import open_http
from core.settings import Settings
from tests.helpers import BOARD_TOKEN, BoardServer


@pytest.fixture
def inner(settings: Settings) -> Iterator[Board]:
    """The Kanban at ``settings.board_url``, migrated: the board itself, or the one behind the server."""
    board = open_board(settings)
    board.migrate()
    yield board
    board.close()


@pytest.fixture(params=["direct", "http"])
def kanban(request: pytest.FixtureRequest, settings: Settings, inner: Board) -> Iterator[Board]:
    if request.param == "direct":
        yield inner
        return
    served = replace(settings, board_token=BOARD_TOKEN)
    server = BoardServer(served, inner)
    client = open_http(server.url, served)
    yield client
    client.close()
    server.stop()


@pytest.fixture
def engine_of(engine_of: Callable[[Board], Engine], inner: Board) -> Callable[[Board], Engine]:
    """tests/conftest.py's, always of the Kanban itself (over HTTP, the one behind the server)."""
    kanban_engine = engine_of
    return lambda _board: kanban_engine(inner)

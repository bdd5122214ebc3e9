"""The plane's integration environment: a private redis-server, SQLite files, settings from the marker."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from board import open_board
from poolkeeper.embedded import RedisServer
from store import PoolStore
from tests.helpers import DAY, PlaneEnv, make_settings, staff


@pytest.fixture
def env(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[PlaneEnv]:
    """The plane's files and Redis, with ``@pytest.mark.plane_settings(...)`` over ``make_settings``."""
    server = RedisServer(tmp_path).start()
    marker = request.node.get_closest_marker("plane_settings")
    settings = make_settings(tmp_path, server.url, **(marker.kwargs if marker else {}))
    store, kanban = PoolStore.from_settings(settings), open_board(settings)
    store.migrate()
    kanban.migrate()
    e = PlaneEnv(tmp_path, server, settings, store, kanban)
    staff(store, range(settings.pool_size), time.time() + DAY)  # a worker on each ordinal, polling
    yield e
    for proc in e.procs:
        proc.stop()
    kanban.close()
    server.stop()

"""What every pass works with: settings, store, board, and coordination (``Plane``).

A Celery worker process builds its plane on first use (``current``), on Redis
coordination (``tasks.redis_coordination``); ``poolctl maintain --once`` and unit tests
build theirs on the in-process driver (``tasks.coordination.LocalCoordination``).
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, replace

import redis

from board import Board, open_board, with_faults
from core.errors import ConfigError
from core.logs import mask_url
from core.settings import Settings
from store import PoolStore
from tasks.coordination import Coordination, LocalCoordination, worker_redis_url
from tasks.events import Events
from tasks.redis_coordination import RedisCoordination


@dataclass
class Plane:
    settings: Settings
    store: PoolStore
    board: Board
    coord: Coordination

    @functools.cached_property
    def events(self) -> Events:
        """Wake-ups on the coordination's Redis (none in-process: beat's ticks, or the caller, do it)."""
        client = self.coord.r if isinstance(self.coord, RedisCoordination) else None
        return Events(client, self.settings)

    @classmethod
    def from_settings(
        cls, settings: Settings, store: PoolStore | None = None, board: Board | None = None
    ) -> Plane:
        """The plane on ``settings``, on the store and board given (else opened from the settings).

        A Redis URL that cannot work is a ``ConfigError``; nothing connects yet.
        """
        store = store or PoolStore.from_settings(settings)
        board = with_faults(board or open_board(settings), settings)
        return cls(settings, store, board, coordination(settings))


def coordination(settings: Settings) -> Coordination:
    """Redis coordination on ``settings.redis_url``, else in-process.

    A URL that cannot work is a ``ConfigError``; nothing connects yet.
    """
    if not settings.redis_url:
        return LocalCoordination()
    try:
        client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=5)
    except ValueError as err:
        raise ConfigError(f"redis URL {mask_url(settings.redis_url)!r}: {err}") from None
    return RedisCoordination(client, settings)


_current: Plane | None = None
_current_lock = threading.Lock()


def check_ready(settings: Settings) -> None:
    """The store and the board answer and are migrated to head: else ``ConfigError`` (a setting
    or ``poolctl init`` is missing) or ``TransientError``/``Unavailable`` (worth waiting for)."""
    store = PoolStore.from_settings(settings)
    try:
        store.require_schema(writable=True)
    finally:
        store.engine.dispose()
    board = open_board(settings)
    try:
        board.require_schema(writable=True)
    finally:
        board.close()


def current() -> Plane:
    """This worker process's plane, built on first use (never at import or start-up)."""
    global _current
    with _current_lock:
        if _current is None:
            settings = Settings.from_env()
            _current = Plane.from_settings(replace(settings, redis_url=worker_redis_url(settings)))
        return _current


def forget_after_fork() -> None:
    """A forked child builds its own plane: no connection is shared across a fork."""
    global _current
    _current = None

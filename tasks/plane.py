"""What every pass works with: settings, store, board, and Redis coordination.

Coordination is three small things kept in Redis, all of them advisory
(correctness comes from the store's conditional updates and fences):

- row locks: ``SET key token NX PX ttl``, released only by their token;
- pending markers: at most one queued message per (pass, key);
- ordinal reservations: an ordinal promised to a claim that is on its way.

Every key starts with the deployment's namespace (``POOL_NAMESPACE``), as do
its queue (``queue_name``) and task names, so deployments sharing one Redis
never see each other's work.

``LocalCoordination`` is the same in one process, for ``poolctl maintain --once``
without Redis and for unit tests.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import redis

from board import Board, KanbanBoard, open_board
from core.errors import TransientError
from core.settings import Settings
from store import PoolStore

_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"


class Coordination(Protocol):
    def lock_many(self, keys: list[str]) -> list[str | None]:
        """One token per key, or None where another worker holds the lock."""
        ...

    def unlock_many(self, held: dict[str, str]) -> None: ...

    def mark_pending(self, pass_name: str, keys: Iterable[str]) -> list[str]: ...

    def clear_pending(self, pass_name: str, keys: Iterable[str]) -> None: ...

    def is_pending(self, pass_name: str, key: str) -> bool: ...

    def reserve(self, ordinal: int) -> bool: ...

    def release(self, ordinal: int) -> None: ...


class RedisCoordination:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.r = client
        self.prefix = settings.namespace
        self._release = client.register_script(_RELEASE)  # EVALSHA: the script is sent once
        self.lock_ms = int(settings.lock_ttl_seconds * 1000)
        # A marker outlives any message it stands for: a lost message is redelivered
        # within the visibility timeout, so it never needs a second one.
        self.pending_s = int(settings.visibility_timeout + settings.task_time_limit)
        self.reserve_s = int(2 * settings.task_time_limit + settings.tick_seconds)

    def lock_many(self, keys: list[str]) -> list[str | None]:
        tokens = [uuid.uuid4().hex for _ in keys]
        with _redis_errors(), self.r.pipeline(transaction=False) as pipe:
            for key, token in zip(keys, tokens, strict=True):
                pipe.set(f"{self.prefix}:lock:{key}", token, nx=True, px=self.lock_ms)
            won = pipe.execute()
        return [token if ok else None for token, ok in zip(tokens, won, strict=True)]

    def unlock_many(self, held: dict[str, str]) -> None:
        if not held:
            return
        with _redis_errors(), self.r.pipeline(transaction=False) as pipe:
            for key, token in held.items():
                self._release(keys=[f"{self.prefix}:lock:{key}"], args=[token], client=pipe)
            pipe.execute()

    def mark_pending(self, pass_name: str, keys: Iterable[str]) -> list[str]:
        keys = list(keys)
        with _redis_errors(), self.r.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.set(f"{self.prefix}:pending:{pass_name}:{key}", "1", nx=True, ex=self.pending_s)
            won = pipe.execute()
        return [key for key, ok in zip(keys, won, strict=True) if ok]

    def clear_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        names = [f"{self.prefix}:pending:{pass_name}:{key}" for key in keys]
        if names:
            with _redis_errors():
                self.r.delete(*names)

    def is_pending(self, pass_name: str, key: str) -> bool:
        with _redis_errors():
            return bool(self.r.exists(f"{self.prefix}:pending:{pass_name}:{key}"))

    def reserve(self, ordinal: int) -> bool:
        with _redis_errors():
            return bool(self.r.set(f"{self.prefix}:reserved:{ordinal}", "1", nx=True, ex=self.reserve_s))

    def release(self, ordinal: int) -> None:
        with _redis_errors():
            self.r.delete(f"{self.prefix}:reserved:{ordinal}")


class LocalCoordination:
    """In-process coordination (one process, no Redis)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._locks: dict[str, str] = {}
        self._pending: set[tuple[str, str]] = set()
        self._reserved: set[int] = set()

    def lock_many(self, keys: list[str]) -> list[str | None]:
        with self._mu:
            tokens: list[str | None] = []
            for key in keys:
                token = None if key in self._locks else uuid.uuid4().hex
                if token is not None:
                    self._locks[key] = token
                tokens.append(token)
            return tokens

    def unlock_many(self, held: dict[str, str]) -> None:
        with self._mu:
            for key, token in held.items():
                if self._locks.get(key) == token:
                    del self._locks[key]

    def mark_pending(self, pass_name: str, keys: Iterable[str]) -> list[str]:
        with self._mu:
            fresh = [k for k in keys if (pass_name, k) not in self._pending]
            self._pending.update((pass_name, k) for k in fresh)
            return fresh

    def clear_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        with self._mu:
            self._pending.difference_update((pass_name, k) for k in keys)

    def is_pending(self, pass_name: str, key: str) -> bool:
        return (pass_name, key) in self._pending

    def reserve(self, ordinal: int) -> bool:
        with self._mu:
            if ordinal in self._reserved:
                return False
            self._reserved.add(ordinal)
            return True

    def release(self, ordinal: int) -> None:
        with self._mu:
            self._reserved.discard(ordinal)


class _redis_errors:
    """Redis trouble (connection refused, timeout) is transient: retry the row later."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: object) -> None:
        if isinstance(err, redis.RedisError | OSError):
            raise TransientError(f"redis: {err}") from err


@dataclass
class Plane:
    settings: Settings
    store: PoolStore
    board: Board
    coord: Coordination

    @classmethod
    def from_settings(cls, settings: Settings) -> Plane:
        coord: Coordination
        if not settings.redis_url:
            coord = LocalCoordination()
        else:
            client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=5)
            coord = RedisCoordination(client, settings)
        return cls(settings, PoolStore.from_settings(settings), open_board(settings), coord)


_current: Plane | None = None
_current_lock = threading.Lock()


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def queue_name(settings: Settings) -> str:
    """The one maintenance queue of the deployment."""
    return f"{settings.namespace}.maintenance"


def worker_redis_url(settings: Settings) -> str:
    """Workers and beat always use Redis (broker, locks and markers alike): the local one by default."""
    return settings.redis_url or DEFAULT_REDIS_URL


def check_ready(settings: Settings) -> None:
    """The store and the board answer and are migrated, else ``NotReady`` or ``TransientError``."""
    for target in (PoolStore.from_settings(settings), KanbanBoard(settings.board_url)):
        try:
            target.check_ready()
        finally:
            target.engine.dispose()


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

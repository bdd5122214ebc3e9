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

import json
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Protocol

import redis

from board import Board, open_board, with_faults
from core.db import mask_url
from core.errors import ConfigError, TransientError, Unavailable
from core.settings import Settings
from store import PoolStore

# Each script takes a whole batch in one round trip: a key prefix and the batch's names as
# one JSON array (ARGV), the keys composed inside the script. One argument per batch, not
# one per key: packing a thousand keys cost the client more than Redis spent on them.
# (A single Redis server allows keys a script composes; the Celery broker is one anyway.)
#
# Locks: one token per batch; the indexes (1-based) of the names it did NOT win come back
# (in a storm, none: a reply of a thousand won indexes cost more to parse than the locking).
_LOCK = """
local busy = {}
for i, name in ipairs(cjson.decode(ARGV[4])) do
  if not redis.call('set', ARGV[3] .. name, ARGV[1], 'NX', 'PX', ARGV[2]) then busy[#busy + 1] = i end
end
return busy
"""
# Released only where the token still holds.
_UNLOCK = """
local n = 0
for _, name in ipairs(cjson.decode(ARGV[3])) do
  local key = ARGV[2] .. name
  if redis.call('get', key) == ARGV[1] then n = n + redis.call('del', key) end
end
return n
"""
# Pending markers: set where absent; the indexes of those already pending come back.
_MARK = """
local pending = {}
for i, name in ipairs(cjson.decode(ARGV[3])) do
  if not redis.call('set', ARGV[2] .. name, '1', 'NX', 'EX', ARGV[1]) then pending[#pending + 1] = i end
end
return pending
"""
_FORGET = """
local n = 0
for _, name in ipairs(cjson.decode(ARGV[2])) do n = n + redis.call('del', ARGV[1] .. name) end
return n
"""


def _batch(names: list[str]) -> str:
    """A batch's names as the scripts read them (UTF-8 as is, as redis-py would send a key)."""
    return json.dumps(names, ensure_ascii=False, separators=(",", ":"))


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

    def ping(self) -> None:
        """Raise ``Unavailable`` unless the coordination server answers."""
        ...

    def record_scan(self, pass_name: str, now: float) -> None:
        """Stamp the pass's last scan (``tasks.liveness`` reads it)."""
        ...


class RedisCoordination:
    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.r = client
        self.prefix = settings.namespace
        # EVALSHA: each script is sent once, then named by its digest
        scripts = (_LOCK, _UNLOCK, _MARK, _FORGET)
        self._lock, self._unlock, self._mark, self._forget = (client.register_script(s) for s in scripts)
        self.lock_ms = int(settings.lock_ttl_seconds * 1000)
        # A marker outlives any message it stands for: a lost message is redelivered
        # within the visibility timeout, so it never needs a second one.
        self.pending_s = int(settings.visibility_timeout + settings.task_time_limit)
        self.reserve_s = int(2 * settings.task_time_limit + settings.tick_seconds)
        self.where = f"redis at {mask_url(settings.redis_url)}"

    def lock_many(self, keys: list[str]) -> list[str | None]:
        if not keys:
            return []
        token = uuid.uuid4().hex
        with _redis_errors():
            busy = set(self._lock(args=[token, self.lock_ms, f"{self.prefix}:lock:", _batch(keys)]))
        return [None if i in busy else token for i in range(1, len(keys) + 1)]

    def unlock_many(self, held: dict[str, str]) -> None:
        by_token: dict[str, list[str]] = {}
        for key, token in held.items():
            by_token.setdefault(token, []).append(key)
        with _redis_errors():
            for token, names in by_token.items():
                self._unlock(args=[token, f"{self.prefix}:lock:", _batch(names)])

    def mark_pending(self, pass_name: str, keys: Iterable[str]) -> list[str]:
        keys = list(keys)
        if not keys:
            return []
        with _redis_errors():
            pending = set(
                self._mark(args=[self.pending_s, f"{self.prefix}:pending:{pass_name}:", _batch(keys)])
            )
        return [k for i, k in enumerate(keys, 1) if i not in pending]

    def clear_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        names = list(keys)
        if names:
            with _redis_errors():
                self._forget(args=[f"{self.prefix}:pending:{pass_name}:", _batch(names)])

    def is_pending(self, pass_name: str, key: str) -> bool:
        with _redis_errors():
            return bool(self.r.exists(f"{self.prefix}:pending:{pass_name}:{key}"))

    def reserve(self, ordinal: int) -> bool:
        with _redis_errors():
            return bool(self.r.set(f"{self.prefix}:reserved:{ordinal}", "1", nx=True, ex=self.reserve_s))

    def release(self, ordinal: int) -> None:
        with _redis_errors():
            self.r.delete(f"{self.prefix}:reserved:{ordinal}")

    def ping(self) -> None:
        with _redis_errors(self.where):
            self.r.ping()

    def record_scan(self, pass_name: str, now: float) -> None:
        with _redis_errors(self.where):
            self.r.hset(scans_key(self.prefix), pass_name, repr(now))


class LocalCoordination:
    """In-process coordination (one process, no Redis)."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._locks: dict[str, str] = {}
        self._pending: set[tuple[str, str]] = set()
        self._reserved: set[int] = set()
        self.scans: dict[str, float] = {}

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

    def ping(self) -> None:
        return None

    def record_scan(self, pass_name: str, now: float) -> None:
        self.scans[pass_name] = now


class _redis_errors:
    """Redis trouble is transient: retry the row later. Cannot reach it (refused, timeout): Unavailable."""

    def __init__(self, where: str = "redis") -> None:
        self.where = where

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: object) -> None:
        if isinstance(err, redis.ConnectionError | redis.TimeoutError | OSError):
            raise Unavailable(f"{self.where} is unavailable: {err}") from err
        if isinstance(err, redis.RedisError):
            raise TransientError(f"{self.where}: {err}") from err


@dataclass
class Plane:
    settings: Settings
    store: PoolStore
    board: Board
    coord: Coordination

    @classmethod
    def from_settings(
        cls, settings: Settings, store: PoolStore | None = None, kanban: Board | None = None
    ) -> Plane:
        """The plane on ``settings``, on the store and board given (else opened from the settings).

        A Redis URL that cannot work is a ``ConfigError``; nothing connects yet.
        """
        coord: Coordination
        if not settings.redis_url:
            coord = LocalCoordination()
        else:
            try:
                client = redis.Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=5)
            except ValueError as err:
                raise ConfigError(f"redis URL {mask_url(settings.redis_url)!r}: {err}") from None
            coord = RedisCoordination(client, settings)
        store = store or PoolStore.from_settings(settings)
        return cls(settings, store, with_faults(kanban or open_board(settings), settings), coord)


_current: Plane | None = None
_current_lock = threading.Lock()


DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def queue_name(settings: Settings) -> str:
    """The one maintenance queue of the deployment."""
    return f"{settings.namespace}.maintenance"


def scans_key(namespace: str) -> str:
    """The hash of each pass's last scan (``tasks.liveness``)."""
    return f"{namespace}:scans"


def process_task(settings: Settings) -> str:
    """The name of the per-key task (``tasks.celery.process``) in the deployment's namespace."""
    return f"{settings.namespace}.process"


def worker_redis_url(settings: Settings) -> str:
    """Workers and beat always use Redis (broker, locks and markers alike): the local one by default."""
    return settings.redis_url or DEFAULT_REDIS_URL


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

"""The plane's coordination: the ``Coordination`` protocol, its in-process driver, and the names.

Coordination is a few small things, all of them advisory (correctness comes from the
store's conditional updates and fences):

- row locks (and the ``dispatch`` lock): taken with a token, released only by it;
- pending markers: at most one queued message per (pass, key);
- ordinal reservations: an ordinal promised to a claim that is on its way;
- waiting claims: claims that found no ordinal free, which dispatch serves first.

Two drivers: ``tasks.redis_coordination.RedisCoordination`` (every worker and beat of a
deployment; what a process holds outlives it by a hold at most) and ``LocalCoordination``
here, the same in one process, for ``poolctl maintain --once`` without Redis and for unit
tests. ``tests/plane/test_coordination.py`` runs one contract suite over both.

Every Redis key starts with the deployment's namespace (``POOL_NAMESPACE``), as do
its queue (``queue_name``) and task names, so deployments sharing one Redis
never see each other's work.
"""

from __future__ import annotations

import os
import socket
import threading
import uuid
from collections.abc import Iterable
from typing import Protocol

from core.settings import Settings

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def queue_name(settings: Settings) -> str:
    """The one maintenance queue of the deployment."""
    return f"{settings.namespace}.maintenance"


def queue_lists(settings: Settings) -> list[str]:
    """The Redis lists that hold the maintenance queue's messages (kombu's one per priority step).

    A message without a priority (all of this project's) is in the first; kombu's Redis
    transport names the others ``<queue>\\x06\\x16<step>`` for its default steps 3, 6 and 9.
    """
    queue = queue_name(settings)
    return [queue, *(f"{queue}\x06\x16{step}" for step in (3, 6, 9))]


def scans_key(namespace: str) -> str:
    """The hash of each pass's last scan (``tasks.liveness``)."""
    return f"{namespace}:scans"


def scanning_since_key(namespace: str) -> str:
    """When the deployment's first scan was stamped (``tasks.liveness``: a pass not yet due is not late)."""
    return f"{namespace}:scanning-since"


def waiting_key(namespace: str) -> str:
    """The sorted set of claims waiting for an ordinal, oldest first (``Coordination.wait_for_ordinal``)."""
    return f"{namespace}:waiting"


def processes_key(namespace: str) -> str:
    """The hash of each Celery worker's and beat's last beacon (``tasks.redis_coordination.Beacon``)."""
    return f"{namespace}:processes"


def process_task(settings: Settings) -> str:
    """The name of the per-key task (``tasks.celery.process``) in the deployment's namespace."""
    return f"{settings.namespace}.process"


def worker_redis_url(settings: Settings) -> str:
    """Workers and beat always use Redis (broker, locks and markers alike): the local one by default."""
    return settings.redis_url or DEFAULT_REDIS_URL


def holder_token() -> str:
    """A token that names its holder (``host:pid:random``), so an operator sees who holds a key."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:16]}"


class Coordination(Protocol):
    def lock_many(self, keys: list[str]) -> list[str | None]:
        """One token per key, or None where another worker holds the lock; held while this process lives."""
        ...

    def unlock_many(self, held: dict[str, str]) -> None: ...

    def mark_pending(self, pass_name: str, keys: Iterable[str]) -> list[str]:
        """Mark the keys' messages pending, held by this process until ``queue_pending`` (as
        ``reserve`` until ``queue_reserved``); those already pending are left out of the answer."""
        ...

    def queue_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        """Markers this process holds now stand for messages in the queue (``queued_seconds``)."""
        ...

    def clear_pending(self, pass_name: str, keys: Iterable[str]) -> None: ...

    def finish(self, held: dict[str, str], pass_name: str, done: Iterable[str]) -> None:
        """``unlock_many(held)`` and ``clear_pending(pass_name, done)`` at once: a batch's end."""
        ...

    def reserve(self, ordinals: Iterable[int]) -> list[int]:
        """Those of ``ordinals`` this process now holds for claims it is about to hand over."""
        ...

    def queue_reserved(self, ordinals: Iterable[int]) -> None:
        """Reservations this process holds now stand for claims in the queue (``queued_seconds``)."""
        ...

    def release(self, ordinals: Iterable[int]) -> None: ...

    def wait_for_ordinal(self, claims: dict[str, str]) -> None:
        """Claims (name: JSON) that found no ordinal free wait here; dispatch serves them first."""
        ...

    def take_waiting(self, at_most: int) -> list[str]:
        """Up to ``at_most`` waiting claims' JSON, oldest first, no longer waiting once taken."""
        ...

    def hold(self, pass_name: str, names: Iterable[str], ordinals: Iterable[int], seconds: float) -> None:
        """A received message's pending markers (and its claims' reservations) are this
        process's while it lives, for ``seconds`` at most (then they lapse within a hold)."""
        ...

    def ping(self) -> None:
        """Raise ``Unavailable`` unless the coordination server answers."""
        ...

    def record_scan(self, pass_name: str, now: float) -> None:
        """Stamp the pass's last scan (``tasks.liveness`` reads it)."""
        ...


class LocalCoordination:
    """In-process coordination (one process, no Redis): nothing outlives its holder, nothing to renew."""

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._locks: dict[str, str] = {}
        self._pending: set[tuple[str, str]] = set()
        self._reserved: set[int] = set()
        self._waiting: dict[str, str] = {}  # insertion order: oldest first
        self.scans: dict[str, float] = {}

    def lock_many(self, keys: list[str]) -> list[str | None]:
        with self._mu:
            tokens: list[str | None] = []
            for key in keys:
                token = None if key in self._locks else holder_token()
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

    def queue_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        return None

    def clear_pending(self, pass_name: str, keys: Iterable[str]) -> None:
        with self._mu:
            self._pending.difference_update((pass_name, k) for k in keys)

    def finish(self, held: dict[str, str], pass_name: str, done: Iterable[str]) -> None:
        self.unlock_many(held)
        self.clear_pending(pass_name, done)

    def reserve(self, ordinals: Iterable[int]) -> list[int]:
        with self._mu:
            won = [o for o in ordinals if o not in self._reserved]
            self._reserved.update(won)
            return won

    def queue_reserved(self, ordinals: Iterable[int]) -> None:
        return None

    def release(self, ordinals: Iterable[int]) -> None:
        with self._mu:
            self._reserved.difference_update(ordinals)

    def wait_for_ordinal(self, claims: dict[str, str]) -> None:
        with self._mu:
            for name, claim in claims.items():
                self._waiting.setdefault(name, claim)

    def take_waiting(self, at_most: int) -> list[str]:
        with self._mu:
            taken = list(self._waiting)[: max(at_most, 0)]
            return [self._waiting.pop(name) for name in taken]

    def hold(self, pass_name: str, names: Iterable[str], ordinals: Iterable[int], seconds: float) -> None:
        return None

    def ping(self) -> None:
        return None

    def record_scan(self, pass_name: str, now: float) -> None:
        self.scans[pass_name] = now

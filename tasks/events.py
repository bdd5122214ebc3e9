"""Events: whatever makes a row or a task due sends its pass's work at once; beat's ticks stay the net.

Three small things in the deployment's Redis, all of them hints (docs/design.md, "Events"):

- ``<ns>:events``, a list of wake-ups, each "scan this pass now", that any process may push
  (``poolctl serve`` when it accepts a result: ``results``; the board's write paths when a
  task turns ready, and the plane's workers when a row frees an ordinal: ``materialize``,
  whose scan is dispatch). Each Celery worker's ``Listener`` pops them and sends that
  pass's scan, which finds the due keys and enqueues them as beat's scan would: the rule
  of one pending message per (pass, key), the row's lock, the guarded update and the
  backoff are the same. The list is capped (``EVENTS_CAP``): with no worker to read it,
  the oldest hints go, and beat's next tick finds their work.
- ``<ns>:wanted:<pass>``, one flag per pass that stands for the one pending scan a wake-up
  asked for: set (with a tick's lifetime) by the first event, taken by the scan as it starts
  reading (``declaration.due_rows``, ``materialize.dispatch``), so a burst of a thousand
  results or adds sends one scan, and an event that comes while a scan runs asks for the
  next one. An ordinal freed always sends a dispatch: one that found no ordinal free left
  its flag standing.
- ``<ns>:assigned``, a pub/sub channel on which the plane says which ordinals now have an
  ``assigned`` row, so a worker's waiting ``offer`` (``poolkeeper.api.waits``) is answered at
  once instead of at its next look.

Nothing depends on an event arriving: a lost one (Redis restarted, a worker died holding
it) costs at most a tick, since beat still scans every pass at its interval, and a
duplicated one costs a lock that is already held or a marker that is already set.
Correctness stays with the store's conditional updates and fences. A producer never
fails its caller for an event: Redis trouble is logged at debug and the producer keeps
quiet for ``QUIET_SECONDS`` (no timeout paid per request while Redis is away).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import redis

from core.settings import Settings

log = logging.getLogger("poolkeeper.events")

EVENTS_CAP = 10_000  # hints kept while no worker reads them; beat finds the rest
QUIET_SECONDS = 1.0  # after a failed push, a producer sends nothing for this long


def events_key(namespace: str) -> str:
    return f"{namespace}:events"


def wanted_key(namespace: str, what: str) -> str:
    return f"{namespace}:wanted:{what}"


def assigned_channel(namespace: str) -> str:
    return f"{namespace}:assigned"


Event = dict[str, Any]  # {"scan": pass name}: JSON in the list


class Events:
    """The producer's side: push wake-ups, ask for a dispatch, say which ordinals were assigned.

    ``client`` None (no Redis: ``poolctl maintain --once``, the in-process plane) makes every
    call a no-op: beat's ticks, or the caller's own loop, do the work.
    """

    def __init__(self, client: redis.Redis | None, settings: Settings) -> None:
        self.client = client
        self.namespace = settings.namespace
        self.flag_ms = max(1, int(settings.tick_seconds * 1000))
        self._quiet_until = 0.0

    @classmethod
    def from_settings(cls, settings: Settings, redis_url: str) -> Events:
        """Events on ``redis_url`` with short timeouts (a producer waits on Redis as little as it can)."""
        if not redis_url:
            return cls(None, settings)
        try:
            client = redis.Redis.from_url(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        except ValueError:
            return cls(None, settings)  # the plane refuses such a URL itself, with the reason
        return cls(client, settings)

    def scan_due(self, pass_name: str, *, force: bool = False) -> None:
        """Rows or tasks of ``pass_name`` are due now: ask for one scan, unless one is asked for
        already; ``force`` sends one whatever was asked (an ordinal freed: a dispatch that found
        none free left its flag standing)."""
        self._send(lambda c: self._ask(c, pass_name, force))

    def assigned(self, ordinals: Iterable[int]) -> None:
        """These ordinals have an ``assigned`` row now: wake their waiting offers."""
        names = ",".join(str(o) for o in sorted(set(ordinals)))
        if names:
            self._send(lambda c: c.publish(assigned_channel(self.namespace), names))

    def take(self, pass_name: str) -> bool:
        """Whether a scan of ``pass_name`` was asked for since the last take (its scan takes it
        as it starts reading, so what is asked for from then on asks for the next one)."""
        return bool(self._send(lambda c: c.getdel(wanted_key(self.namespace, pass_name))))

    def asked(self, pass_name: str) -> bool:
        return bool(self._send(lambda c: c.exists(wanted_key(self.namespace, pass_name))))

    def _ask(self, client: redis.Redis, pass_name: str, force: bool) -> None:
        if client.set(wanted_key(self.namespace, pass_name), 1, nx=not force, px=self.flag_ms) or force:
            key = events_key(self.namespace)
            pipe = client.pipeline(transaction=False)
            pipe.rpush(key, json.dumps({"scan": pass_name}, separators=(",", ":")))
            pipe.ltrim(key, -EVENTS_CAP, -1)  # the newest hints; beat finds what the oldest asked for
            pipe.execute()

    def _send(self, call: Callable[[redis.Redis], Any]) -> Any:
        if self.client is None or time.monotonic() < self._quiet_until:
            return None
        try:
            return call(self.client)
        except (redis.RedisError, OSError) as err:
            self._quiet_until = time.monotonic() + QUIET_SECONDS
            log.debug("event not sent (beat's next tick does the work): %s", err)
            return None


# A row leaving these frees its ordinal (from ``result``, a live row, or an expired last lease).
FREES = frozenset({"finalized", "stale", "lease_failed"})


def after_batch(
    events: Events, reserves: Callable[[Any], int] | None, done: Iterable[tuple[Any, str]], pool_size: int
) -> None:
    """What a batch's outcomes make due at once: a freed ordinal asks for a dispatch, and an
    ``assigned`` row (a claim added on the ordinal it ``reserves``, a lease re-offered) wakes its
    ordinal's waiting offer."""
    outcomes = [(key, str(outcome)) for key, outcome in done]
    if any(outcome in FREES for _, outcome in outcomes):
        events.scan_due("materialize", force=True)  # dispatch is materialize's scan
    woken = [reserves(key) for key, outcome in outcomes if outcome == "added" and reserves]
    if any(outcome == "reoffered" for _, outcome in outcomes):
        woken = list(range(pool_size))  # a re-offered row's ordinal is not in its key: wake each
    events.assigned(woken)


Handle = Callable[[Event], None]


class Listener:
    """A daemon thread that pops wake-ups from ``<ns>:events`` and hands each to ``handle``.

    One per Celery worker (its main process, beside the keeper): each event goes to one
    listener. Redis trouble is retried with a growing pause (at most ``MAX_PAUSE``); an
    event ``handle`` fails on is logged and dropped, as a lost one would be.
    """

    MAX_PAUSE = 5.0

    def __init__(self, client: redis.Redis, namespace: str, handle: Handle) -> None:
        self.client, self.key, self.handle = client, events_key(namespace), handle
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="poolkeeper-events", daemon=True)

    def start(self) -> Listener:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    def _run(self) -> None:
        pause = 0.1
        while not self.stopping.is_set():
            try:
                got = self.client.blpop([self.key], timeout=1)
            except (redis.RedisError, OSError) as err:
                log.debug("events: %s; again in %.1f s", err, pause)
                self.stopping.wait(pause)
                pause = min(pause * 2, self.MAX_PAUSE)
                continue
            pause = 0.1
            if got is None:
                continue
            try:
                self.handle(json.loads(got[1]))
            except Exception as err:  # one bad hint never stops the others
                log.warning("events: dropped %r: %s", got[1][:200], err)

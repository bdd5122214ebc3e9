"""An idle worker's ``offer`` waits, bounded, and is answered as soon as its ordinal has a run.

``OfferWaits`` keeps, per ordinal, an ``asyncio.Event`` that the requests waiting on that
ordinal share. It is set when the plane says the ordinal has an ``assigned`` row (the
``<ns>:assigned`` channel of ``tasks.events``, read by one subscriber thread, started by
the first wait), and then replaced, so the next wait starts unset. A waiter takes the
ordinal's event *before* it asks the store, so a run assigned while the store was being
asked wakes it at once. Nothing depends on a wake arriving: a waiter looks again every
``RECHECK_SECONDS`` whatever it hears (a lost message costs at most that), and the wait
never outlasts what the request asked for.

``stop`` (the server is stopping) wakes every waiter and makes every later wait return at
once, so a stop or a restart ends the waits cleanly, with ``grant: null``, instead of
holding the shutdown for up to a wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Iterable

import redis

from tasks.events import assigned_channel

log = logging.getLogger("poolkeeper.server")

RECHECK_SECONDS = 1.0  # a waiter asks the store again this often, woken or not


class OfferWaits:
    def __init__(self, redis_url: str, namespace: str, longest: float) -> None:
        self.redis_url, self.channel = redis_url, assigned_channel(namespace)
        self.longest = longest  # POOL_OFFER_WAIT_SECONDS: no wait outlasts it, whatever was asked
        self.stopped = False
        self._events: dict[int, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = threading.Lock()
        self._subscriber: threading.Thread | None = None

    def event(self, ordinal: int) -> asyncio.Event:
        """The ordinal's current event, to take before asking the store (on the event loop)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._subscribe()
        found = self._events.get(ordinal)
        if found is None:
            found = self._events[ordinal] = asyncio.Event()
        return found

    async def wait(self, woken: asyncio.Event, seconds: float) -> None:
        """Until ``woken`` is set, the server stops, or ``seconds`` (at most a recheck) have passed."""
        if self.stopped:
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(woken.wait(), timeout=max(0.0, min(seconds, RECHECK_SECONDS)))

    def wake(self, ordinals: Iterable[int]) -> None:
        """Wake the waiters of these ordinals (thread-safe: the subscriber calls it)."""
        if self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(self._set, list(ordinals))
        except RuntimeError:  # its loop is closed: the server is gone, and every wait with it
            self.stopped = True

    def stop(self) -> None:
        """The server is stopping: every wait ends now, and later ones return at once."""
        self.stopped = True
        self.wake(list(self._events))

    def _set(self, ordinals: list[int]) -> None:
        for o in ordinals:
            woken = self._events.pop(o, None)
            if woken is not None:
                woken.set()

    def _subscribe(self) -> None:
        with self._started:
            if self._subscriber is None and self.redis_url:
                self._subscriber = threading.Thread(
                    target=self._listen, name="poolkeeper-offers", daemon=True
                )
                self._subscriber.start()

    def _listen(self) -> None:
        """Read the channel for as long as the process lives; Redis trouble: subscribe again, slower."""
        pause = 0.1
        while not self.stopped:
            try:
                client = redis.Redis.from_url(self.redis_url, socket_timeout=5, socket_connect_timeout=2)
                with client.pubsub(ignore_subscribe_messages=True) as sub:  # type: ignore[no-untyped-call]
                    sub.subscribe(self.channel)
                    pause = 0.1
                    while not self.stopped:
                        message = sub.get_message(timeout=1.0)
                        if message is not None:
                            self.wake(_ordinals(message["data"]))
            except (redis.RedisError, OSError, ValueError) as err:
                log.debug(
                    "offer wake-ups: %s; again in %.1f s (waits look every %.0f s meanwhile)",
                    err,
                    pause,
                    RECHECK_SECONDS,
                )
                threading.Event().wait(pause)
                pause = min(pause * 2, 5.0)


def _ordinals(data: bytes | str) -> list[int]:
    text = data.decode() if isinstance(data, bytes) else data
    return [int(part) for part in text.split(",") if part.strip().isdigit()]

"""Simulated pool workers for the demo and the tests: one thread per ordinal.

Each takes its ordinal's assignment (``offer``, as a worker instance with its
own ``owner`` id), heartbeats while it works and delivers a result, all through
real envelopes, through any ``WorkerPort``: the store's Python API
(``PoolStore``), or the wire protocol (``poolkeeper.workerhost.client.HttpPool``, as the
demo does). Faults, drawn per assignment:
- crash: the worker dies right after taking the run; its restarted self (a new
  owner) asks ``offer`` and gets the same run back at once, same attempt, under
  a new fence;
- hang: the worker stops heartbeating and, long after its lease, wakes up and
  delivers anyway; the lease expires meanwhile and the store must refuse that
  stale holder. The woken worker then goes on polling.
"""

from __future__ import annotations

import random
import threading
import uuid
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from core.errors import PoolError
from core.shapes import Offer
from poolkeeper.workerhost.client import envelope


class WorkerPort(Protocol):
    """The worker protocol as the simulated workers use it; ``PoolStore`` and ``HttpPool`` have it."""

    @property
    def pool_size(self) -> int: ...
    @property
    def lease_seconds(self) -> float: ...
    def offer(self, ordinal: int, *, owner: str) -> Offer | None: ...
    def heartbeat(self, envelope: Mapping[str, Any]) -> str: ...
    def accept_result(self, envelope: Mapping[str, Any]) -> str: ...


@dataclass(frozen=True)
class Faults:
    crash_rate: float = 0.0
    hang_rate: float = 0.0
    work_seconds: float = 0.05


class SimPool:
    def __init__(
        self,
        pool: WorkerPort,
        faults: Faults = Faults(),
        *,
        seed: int | None = None,
        poll_seconds: float = 0.05,
    ) -> None:
        self.pool = pool
        self.faults = faults
        self.poll = poll_seconds
        self.rng = random.Random(seed)
        self.stats: Counter[str] = Counter()
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> SimPool:
        for ordinal in range(self.pool.pool_size):
            t = threading.Thread(target=self._worker, args=(ordinal,), name=f"sim-{ordinal}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)

    def _count(self, what: str) -> None:
        with self._mu:
            self.stats[what] += 1

    def _roll(self) -> float:
        with self._mu:
            return self.rng.random()

    def _worker(self, ordinal: int) -> None:
        owner = instance_id(ordinal)
        while not self._stop.is_set():
            try:
                offer = self.pool.offer(ordinal, owner=owner)
            except PoolError:
                offer = None  # busy store or a lost race with ourselves: poll again
            if offer is None:
                self._stop.wait(self.poll)
                continue
            self._count("offers")
            roll = self._roll()
            if roll < self.faults.crash_rate:
                self._count("crashes")
                owner = instance_id(ordinal)  # the restarted worker is a new instance
                continue
            if roll < self.faults.crash_rate + self.faults.hang_rate:
                self._count("hangs")
                if not self._stop.wait(self.pool.lease_seconds * 1.5):
                    self._deliver(offer)  # long after its lease: refused
                continue
            self._work(offer)

    def _work(self, offer: Offer) -> None:
        beat_every = self.pool.lease_seconds / 3
        remaining = self.faults.work_seconds
        while remaining > 0 and not self._stop.is_set():
            step = min(beat_every, remaining)
            self._stop.wait(step)
            remaining -= step
            try:
                self.pool.heartbeat(envelope(offer))
                self._count("heartbeats")
            except PoolError:
                self._count("refused")
                return
        self._deliver(offer)

    def _deliver(self, offer: Offer) -> None:
        result = {
            "status": "done",
            "answer": f"{offer.task_id} on ordinal {offer.ordinal}, attempt {offer.attempt}",
        }
        try:
            self.pool.accept_result(envelope(offer, payload=result))
            self._count("results")
        except PoolError:
            self._count("refused")


def instance_id(ordinal: int) -> str:
    """A worker instance's ``owner``: new for every (re)start."""
    return f"sim-{ordinal}-{uuid.uuid4().hex[:12]}"

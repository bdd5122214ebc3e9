"""Group commit: the heartbeats that arrive while one transaction commits share the next one.

A heartbeat is a short write whose cost is its commit (an fsync on SQLite's
``synchronous=FULL``, a WAL flush on PostgreSQL). ``GroupCommit`` has one writer
thread: a request hands it its checked envelope and waits; the writer takes every
envelope queued meanwhile (up to ``max_batch``) and applies them with
``PoolStore.heartbeats``: one transaction, each under its own savepoint, one
commit. Each request then gets its own outcome, or its own error (a stale fence
is that heartbeat's 409 alone). A transaction that fails as a whole (a database
error, the commit) wrote nothing: its heartbeats are tried again one per
transaction, so an error stays the heartbeat's that caused it. Nothing is
answered before its commit.

No heartbeat waits for a timer: a lone one is applied at once, and a batch only
forms while the previous one is committing. On SQLite one writer is this
process's only heartbeat writer, so it queues on the server's write gate once per
batch rather than once per request. PostgreSQL takes row locks, and a lone
writer there waits out each round trip in turn: a few writers (``writers``),
each with its own transaction, overlap them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class GroupCommit(Generic[T, R]):
    """``await group(item)``: ``apply`` runs on a batch of items in one writer thread."""

    def __init__(
        self,
        apply: Callable[[Sequence[T]], Sequence[R | Exception]],
        gate: AbstractContextManager[None],
        *,
        writers: int = 1,
        max_batch: int = 64,
    ) -> None:
        self.apply, self.gate, self.writers, self.max_batch = apply, gate, writers, max_batch
        self._queue: queue.SimpleQueue[tuple[T, Future[R]]] = queue.SimpleQueue()
        self._started = False
        self._starting = threading.Lock()

    async def __call__(self, item: T) -> R:
        return await asyncio.wrap_future(self.submit(item))

    def submit(self, item: T) -> Future[R]:
        if not self._started:
            self._start()  # on first use: a server process's threads, never ones a fork copied
        done: Future[R] = Future()
        self._queue.put((item, done))
        return done

    def _start(self) -> None:
        with self._starting:
            for n in range(0 if self._started else self.writers):
                threading.Thread(target=self._write, name=f"group-commit-{n}", daemon=True).start()
            self._started = True

    def _write(self) -> None:
        while True:
            batch = [self._queue.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            self._commit(batch)

    def _commit(self, batch: list[tuple[T, Future[R]]]) -> None:
        for (_, done), answer in zip(batch, self._answers([item for item, _ in batch]), strict=True):
            if isinstance(answer, Exception):
                done.set_exception(answer)
            else:
                done.set_result(answer)

    def _answers(self, items: list[T]) -> Sequence[R | Exception]:
        """Each item's answer. A transaction that failed as a whole wrote nothing: its items are
        tried again one per transaction, so an error one of them caused stays its own."""
        try:
            with self.gate:
                return self.apply(items)
        except Exception as err:
            if len(items) == 1:
                return [err]
        return [answer for item in items for answer in self._answers([item])]

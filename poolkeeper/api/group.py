"""Group commit: the heartbeats that arrive while one transaction commits share the next one.

A heartbeat is a short write whose cost is its commit (an fsync on SQLite's
``synchronous=FULL``, a WAL flush on PostgreSQL). ``GroupCommit`` has a writer
thread per shard: a request hands it its checked envelope and waits; the writer takes every
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
each with its own transaction, overlap them, each ordinal's heartbeats always on the
same writer (``shard``). A request whose caller went away is not applied, and the
writers outlive whatever a batch raises: every request is answered.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Generic, TypeVar

from core import tracing
from core.errors import TransientError

T = TypeVar("T")
R = TypeVar("R")
log = logging.getLogger("poolkeeper.serve")
# An item, its answer's future, and the traceparent of the request that sent it (None: untraced)
Entry = tuple[T, Future[R], str | None]
Queue = queue.SimpleQueue[Entry[T, R]]


class GroupCommit(Generic[T, R]):
    """``await group(item)``: ``apply`` runs on a batch of items in a writer thread.

    With several writers, ``shard`` names each item's writer (``shard(item) % writers``):
    every item of one shard (one ordinal's heartbeats) goes through one writer, so two
    batches under way never wait on each other's row locks, nor deadlock on them.
    """

    def __init__(
        self,
        apply: Callable[[Sequence[T]], Sequence[R | Exception]],
        gate: AbstractContextManager[None],
        *,
        writers: int = 1,
        shard: Callable[[T], int] = lambda _item: 0,
        max_batch: int = 64,
    ) -> None:
        self.apply, self.gate, self.shard, self.max_batch = apply, gate, shard, max_batch
        self._queues: list[Queue[T, R]] = [queue.SimpleQueue() for _ in range(writers)]
        self._started = False
        self._starting = threading.Lock()

    async def __call__(self, item: T) -> R:
        return await asyncio.wrap_future(self.submit(item))

    def submit(self, item: T) -> Future[R]:
        if not self._started:
            self._start()  # on first use: a server process's threads, never ones a fork copied
        done: Future[R] = Future()
        self._queues[self.shard(item) % len(self._queues)].put((item, done, tracing.current()))
        return done

    def _start(self) -> None:
        with self._starting:
            for n, q in enumerate([] if self._started else self._queues):
                threading.Thread(target=self._write, args=(q,), name=f"group-commit-{n}", daemon=True).start()
            self._started = True

    def _write(self, q: Queue[T, R]) -> None:
        while True:
            batch = [q.get()]
            while len(batch) < self.max_batch:
                try:
                    batch.append(q.get_nowait())
                except queue.Empty:
                    break
            self._commit(batch)

    def _commit(self, batch: list[Entry[T, R]]) -> None:
        """Answer each of the batch's live requests; whatever happens, the writer goes on.

        A request whose caller went away (its future cancelled) is not applied. An error
        that escapes ``apply`` (never an item's own: those are answers) answers every item
        of the batch, so no request waits for ever on a writer that died."""
        live = [entry for entry in batch if entry[1].set_running_or_notify_cancel()]
        if not live:
            return
        first, *others = [traced for _, _, traced in live]  # the batch is a span of the first's trace,
        try:  # linked to every other request's (tracing off: a no-op)
            with tracing.span("heartbeat batch", first, {"pool.heartbeats": len(live)}, links=others):
                answers = self._answers([item for item, _, _ in live])
        except BaseException as err:  # the writer must outlive anything apply raises
            log.exception("group commit: a batch of %d failed as a whole", len(live))
            answers = [TransientError(f"the heartbeat was not applied: {type(err).__name__}")] * len(live)
        for (_, done, _), answer in zip(live, answers, strict=True):
            if isinstance(answer, Exception):
                done.set_exception(answer)
            else:
                done.set_result(answer)

    def _answers(self, items: list[T]) -> Sequence[R | Exception]:
        """Each item's answer. A transaction that failed as a whole wrote nothing. If the store
        was away or busy (``TransientError``: no item's fault), every item gets that answer at
        once, not after a wait per item; otherwise the items are tried again one per
        transaction, so an error one of them caused stays its own."""
        try:
            with self.gate:
                return self.apply(items)
        except Exception as err:
            if len(items) == 1 or isinstance(err, TransientError):
                return [err] * len(items)
        return [answer for item in items for answer in self._answers([item])]

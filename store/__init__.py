"""The durable pool store: one row per claimed board run (see ``store.models``).

``PoolStore`` is the pool worker protocol as a Python API (offer, heartbeat,
accept_result, release, and child executions: register_child, child_heartbeat,
child_result, child_vanished), each call one short transaction. The maintenance passes use
``store.transitions``, ``store.bookkeeping`` and ``store.queries`` directly
inside their own session. Nothing here reads the settings: the values a call
needs are passed in (``PoolStore.from_settings`` unpacks them at the edge).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

from sqlalchemy import Connection, Engine
from sqlalchemy.orm import Session

from core import db, shapes, validate
from core.errors import CorruptRow, InvalidInput, PoolError, TransientError
from core.retry import RetryPolicy
from core.settings import Settings, default
from core.shapes import PROTOCOL_VERSION, Offer
from store import audit, lineage, presence, transitions, worker
from store.envelope import Envelope
from store.lineage import Child
from store.models import Call, metadata

__all__ = ["PROTOCOL_VERSION", "Child", "Envelope", "Offer", "PoolStore"]
KEPT_SECONDS = 1.0  # a batch writer's connection, idle this long, goes back to the pool (``heartbeats``)


class PoolStore:
    def __init__(
        self,
        url: str,
        *,
        pool_size: int = default("pool_size"),
        lease_seconds: float = default("lease_seconds"),
        max_attempts: int = default("max_attempts"),
        lineage_max_depth: int = default("lineage_max_depth"),
        engine: Engine | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self.url = url
        self.pool_size = pool_size
        self.lease_seconds = lease_seconds
        self.max_attempts = max_attempts
        self.lineage_max_depth = lineage_max_depth
        self.engine = engine or db.make_engine(url)
        self.retry = retry or RetryPolicy()  # backoff of a row that ``offer`` finds unreadable
        # Checked once before the first transaction (``_require_set_up``), when the store made its
        # own engine. A caller that hands one in checks readiness itself (`poolctl serve`: /readyz).
        self._set_up = engine is not None
        # which ordinals' presence this handle wrote lately; fresh within a quarter lease, as
        # dispatch fills only ordinals seen within one
        self._presence = presence.Gate(min(presence.EVERY_SECONDS, lease_seconds / 4))
        self._kept = threading.local()  # ``_kept_connection``: each batch writer's connection

    @classmethod
    def from_settings(cls, settings: Settings, engine: Engine | None = None) -> PoolStore:
        return cls(
            settings.database_url,
            pool_size=settings.pool_size,
            lease_seconds=settings.lease_seconds,
            max_attempts=settings.max_attempts,
            lineage_max_depth=settings.lineage_max_depth,
            engine=engine,
            retry=RetryPolicy.from_settings(settings),
        )

    def migrate(self) -> None:
        """Create or upgrade the schema; a no-op when it is current."""
        db.migrate(self.engine, "store", metadata, "pool store")
        self._set_up = True

    def require_schema(self, *, writable: bool = False) -> None:
        """``ConfigError`` unless ``migrate`` has set this store up (creates nothing)."""
        db.require_schema(self.engine, "store", "pool store", writable=writable)
        self._set_up = True

    def _require_set_up(self) -> None:
        """Before this store's first transaction: one that ``poolctl init`` has not set up (no
        file, a missing directory, no schema) is a ``ConfigError`` naming it and what to run,
        and nothing is created: connecting would create the SQLite file, and every call then
        failed on a missing table as a raw driver error (or, with no directory, as busy)."""
        if not self._set_up:
            self.require_schema()

    @contextmanager
    def session(self, *, readonly: bool = False) -> Iterator[Session]:
        self._require_set_up()
        engine = db.readonly(self.engine) if readonly else self.engine
        with db.transaction(engine, "pool store") as s:
            yield s

    @contextmanager
    def connection(self) -> Iterator[Connection]:
        """A Core-level write transaction: the worker protocol's calls and the set-based batches."""
        self._require_set_up()
        with db.transient_errors("pool store", self.engine.url), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def _kept_connection(self) -> Iterator[Connection]:
        """``connection`` for a thread that writes batch after batch (``heartbeats``): the same
        connection while the thread keeps it busy, so a batch does not pay the pool's checkout and
        its ping (a round trip on PostgreSQL, a tenth of the server's CPU per heartbeat). One
        idle for ``KEPT_SECONDS``, or that the database dropped (invalidated), goes back to the
        pool and the next batch checks one out, pinged, as ``connection`` does. ``dropped``
        says the database had dropped the kept one, unknown to the pool: ``heartbeats``
        tries once more on a new one, as the ping would have found it."""
        self._require_set_up()
        kept: Connection | None = getattr(self._kept, "conn", None)
        self._kept.dropped = False
        if kept is not None and self._kept.pid != os.getpid():
            kept = self._kept.conn = None  # the parent's, copied by a fork: never used, never closed here
        if kept is not None and (kept.invalidated or time.monotonic() - self._kept.at > KEPT_SECONDS):
            self._kept.conn = None
            kept.close()
            kept = None
        reused = kept is not None
        if kept is None:
            with db.transient_errors("pool store", self.engine.url):
                kept = self._kept.conn = self.engine.connect()
            self._kept.pid = os.getpid()
        try:
            with db.transient_errors("pool store", self.engine.url), kept.begin():
                yield kept
        finally:
            self._kept.at = time.monotonic()
            self._kept.dropped = reused and kept.invalidated

    def offer(self, ordinal: int, *, owner: str, now: float | None = None) -> Offer | None:
        """Grant the ordinal's run to the worker instance ``owner`` (see ``store.worker.offer``).

        If the store cannot be reached nothing is granted: ``TransientError``. A row
        that cannot be read back is ``CorruptRow``, recorded on the row in a
        transaction of its own (so it backs off and is quarantined where operators look).
        """
        now = _now(now)
        try:
            with self.connection() as conn:
                grant = worker.offer(
                    conn,
                    ordinal,
                    owner=owner,
                    pool_size=self.pool_size,
                    lease_seconds=self.lease_seconds,
                    now=now,
                )
                noted = self._presence.due(ordinal, owner, Call.OFFER, now)
                if noted:
                    presence.note(conn, ordinal, Call.OFFER, now, owner=owner)
            if noted:
                self._presence.written(ordinal, owner, now)
            return grant
        except CorruptRow as err:
            try:
                with self.session() as s:
                    actor = audit.by_worker(ordinal)
                    worker.note_corrupt(s, err.row_id, str(err), policy=self.retry, now=now, actor=actor)
            except PoolError:
                pass  # the record waits for the next poll; the refusal stands either way
            raise

    def heartbeat(
        self, envelope: Envelope | Mapping[str, Any], *, now: float | None = None
    ) -> Literal["applied", "duplicate"]:
        """``envelope``: a mapping the store checks, or an ``Envelope`` already checked (the server's)."""
        env, now = self._envelope(envelope), _now(now)
        with self.connection() as conn:
            outcome = worker.heartbeat(conn, env, lease_seconds=self.lease_seconds, now=now)
            noted = self._note_run(conn, env, Call.HEARTBEAT, now)
        if noted:
            self._presence.written(env.worker_ordinal, None, now)
        return outcome

    def heartbeats(
        self, envelopes: Sequence[Envelope], *, now: float | None = None
    ) -> list[Literal["applied", "duplicate"] | Exception]:
        """Many holders' heartbeats in one transaction and one commit: ``poolctl serve``'s group commit.

        Each is applied as ``heartbeat`` applies it alone, and its answer is its outcome
        or the error it raised (a stale fence, an ended lease, a conflict). The common
        case, the whole batch's in one statement (``worker.new_heartbeats``), writes nothing
        for a heartbeat it does not apply; any other goes the long way under its own
        savepoint, so a refused one is rolled back alone and never fails its neighbours.
        Nothing is answered before the commit: if the transaction fails as a whole (the
        commit, the store away, a database error, a savepoint the database could not undo),
        this raises and none was written.
        """
        now = _now(now)
        # One statement for the batch's common case: the first heartbeat of each run and id
        # (``worker.new_heartbeats``); a later one of the same run takes its turn below.
        first: list[int] = []
        runs, ids = set(), set()
        for n, env in enumerate(envelopes):
            run = (env.board, env.task_id, env.run_id)
            if run not in runs and env.delivery_id not in ids:
                first.append(n)
            runs.add(run)
            ids.add(env.delivery_id)
        try:
            with self._kept_connection() as conn:
                answers, noted = self._heartbeats(conn, envelopes, first, now)
        except TransientError:
            if not self._kept.dropped:
                raise
            with self._kept_connection() as conn:  # the database dropped the one kept: a new one, pinged
                answers, noted = self._heartbeats(conn, envelopes, first, now)
        for ordinal in noted:
            self._presence.written(ordinal, None, now)
        return answers

    def _heartbeats(
        self, conn: Connection, envelopes: Sequence[Envelope], first: list[int], now: float
    ) -> tuple[list[Literal["applied", "duplicate"] | Exception], list[int]]:
        """``heartbeats`` in ``conn``'s transaction: each envelope's answer, and the ordinals noted."""
        lease = self.lease_seconds
        answers: list[Literal["applied", "duplicate"] | Exception] = []
        noted = []
        fast: list[bool | None] = [None] * len(envelopes)
        batch = [envelopes[n] for n in first]
        for n, one in zip(
            first, worker.new_heartbeats(conn, batch, lease_seconds=lease, now=now), strict=True
        ):
            fast[n] = one
        for env, done in zip(envelopes, fast, strict=True):
            if done or (done is None and worker.new_heartbeat(conn, env, lease_seconds=lease, now=now)):
                answers.append("applied")
                if self._note_run(conn, env, Call.HEARTBEAT, now):
                    noted.append(env.worker_ordinal)
                continue
            try:
                with db.transient_errors("pool store", self.engine.url), db.savepoint(conn):
                    answers.append(worker.checked_heartbeat(conn, env, lease_seconds=lease, now=now))
                    if self._note_run(conn, env, Call.HEARTBEAT, now):
                        noted.append(env.worker_ordinal)
            except Exception as err:
                if not db.intact(conn):
                    raise
                answers.append(err)
        return answers, noted

    def accept_result(
        self, envelope: Envelope | Mapping[str, Any], *, now: float | None = None
    ) -> Literal["applied", "duplicate"]:
        """``envelope``: a mapping the store checks, or an ``Envelope`` with its result, already
        checked (the server's ``ResultEnvelope.checked``)."""
        env, now = self._envelope(envelope, with_result=True), _now(now)
        with self.connection() as conn:
            outcome = worker.accept_result(conn, env, now=now)
            noted = self._note_run(conn, env, Call.RESULT, now)
        if noted:
            self._presence.written(env.worker_ordinal, None, now)
        return outcome

    def _note_run(self, conn: Connection, env: Envelope, call: Call, now: float) -> bool:
        """Note the holder's call on its ordinal's presence, unless this handle did lately."""
        if not self._presence.due(env.worker_ordinal, None, call, now):
            return False
        presence.note_run(
            conn, env.worker_ordinal, call, now, board=env.board, task_id=env.task_id, run_id=env.run_id
        )
        return True

    def release(
        self, envelope: Envelope | Mapping[str, Any], *, now: float | None = None
    ) -> Literal["reoffered", "lease_failed", "duplicate"]:
        """The holder hands its run back; the envelope is a heartbeat's (see ``store.worker.release``)."""
        env = self._envelope(envelope)
        with self.connection() as conn:
            return worker.release(conn, env, max_attempts=self.max_attempts, now=_now(now))

    def _envelope(self, given: Envelope | Mapping[str, Any], *, with_result: bool = False) -> Envelope:
        if isinstance(given, Envelope):
            if (given.result is not None) is not with_result:
                raise InvalidInput("envelope", "a result needs its payload; a heartbeat or release has none")
            return given
        return Envelope.parse(given, pool_size=self.pool_size, with_result=with_result)

    # --- child executions (docs/design.md, "Lineage"); the HTTP /v1/children endpoints wrap these ---

    def register_child(self, grant: Mapping[str, Any], *, now: float | None = None) -> Child:
        """The grant's holder registers a child: ``{row_id, attempt, fence, owner[, under][, key]}``.

        ``under`` (a live child's id) nests it one level deeper, up to
        ``lineage_max_depth`` (``LineageTooDeep`` past it). ``key`` (a name the
        caller chooses) makes it idempotent: the same key under the same grant and
        parent returns the same child; without one every call registers a new
        child. The returned ``Child.token()`` is what the child's process reports with.
        """
        g = lineage.Grant.parse(grant, extra=("under", "key"))
        under, key = grant.get("under"), grant.get("key")
        if under is not None:
            lineage.row_of(under, "under")
        if key is not None:
            validate.name("key", key, shapes.KEY_CHARS)
        with self.session() as s:
            return lineage.register(
                s, g, under=under, max_depth=self.lineage_max_depth, now=_now(now), key=key
            )

    def child_heartbeat(self, report: Mapping[str, Any], *, now: float | None = None) -> Literal["applied"]:
        """A child is alive: ``{child_id, epoch[, receipt]}``; refused as stale once it or its grant ended."""
        r = lineage.Report.parse(report, with_result=False)
        with self.session() as s:
            return lineage.heartbeat(s, r, now=_now(now))

    def child_result(
        self, report: Mapping[str, Any], *, now: float | None = None
    ) -> Literal["applied", "duplicate"]:
        """A child's result, ``{child_id, epoch, payload}``: it turns terminal with its descendants."""
        r = lineage.Report.parse(report, with_result=True)
        with self.session() as s:
            return lineage.deliver(s, r, now=_now(now))

    def child_vanished(self, grant: Mapping[str, Any], *, now: float | None = None) -> int:
        """The holder lost a child's worker: ``{row_id, attempt, fence, owner, child_id}`` → ``unknown``."""
        g = lineage.Grant.parse(grant, extra=("child_id",))
        if "child_id" not in grant:
            raise InvalidInput("child_id", "missing")
        lineage.row_of(grant["child_id"])
        with self.session() as s:
            return lineage.vanished(s, g, grant["child_id"], now=_now(now))

    def add_run(
        self,
        *,
        board: str,
        task_id: str,
        run_id: int,
        ordinal: int,
        payload: dict[str, Any],
        now: float | None = None,
        ready_at: float | None = None,
    ) -> Literal["added", "duplicate"]:
        with self.session() as s:
            return transitions.add_run(
                s,
                board=board,
                task_id=task_id,
                run_id=run_id,
                ordinal=ordinal,
                payload=payload,
                pool_size=self.pool_size,
                now=_now(now),
                ready_at=ready_at,
            )


def _now(now: float | None) -> float:
    return time.time() if now is None else now

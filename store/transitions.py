"""Every change of a row's state: each one conditional UPDATE that reports a lost race.

Each function takes the caller's session (one short transaction), a ``now``
(epoch seconds) and the values it needs; none opens a transaction of its own.
A guarded UPDATE that matches nothing raises ``LostRace`` or ``StaleHolder``;
nothing is ever written blind after a read.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, cast

from sqlalchemy import Connection, Table, bindparam, case, delete, exc, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from poolkeeper import validate
from poolkeeper.errors import (
    DeliveryConflict,
    DuplicateIdentity,
    LostRace,
    NotFound,
    OrdinalTaken,
    StaleHolder,
    TransientError,
)
from poolkeeper.settings import Settings
from store.envelope import Envelope
from store.models import TERMINAL_STATES, Assignment, Delivery, FenceSequence, RowState

A = Assignment
# A transition is progress: the row's failure streak ends with it.
_CLEAR_BOOKKEEPING: dict[str, Any] = {
    "failures": 0,
    "last_error": None,
    "next_attempt_at": 0.0,
    "quarantined": False,
}


@dataclass(frozen=True)
class Offer:
    """An ordinal's assignment, as handed to the worker that holds the ordinal."""

    row_id: int
    board: str
    task_id: str
    run_id: int
    ordinal: int
    attempt: int
    fence: int
    lease_until: float
    payload: dict[str, Any]
    payload_digest: str


def add_run(
    s: Session,
    *,
    board: str,
    task_id: str,
    run_id: int,
    ordinal: int,
    payload: dict[str, Any],
    pool_size: int,
    now: float,
) -> Literal["added", "duplicate"]:
    """Record a claimed board run on a free ordinal, attempt 1, state ``assigned``.

    An identical duplicate (same identity, ordinal and payload) is a no-op; a
    conflicting one, or an ordinal that holds a live row, is a ``ProtocolError``.
    """
    validate.name("board", board, 64)
    validate.name("task_id", task_id, 128)
    validate.integer("run_id", run_id, 1)
    validate.integer("ordinal", ordinal, 0, pool_size - 1)
    text = validate.document("payload", payload)
    digest = validate.sha256(text)
    existing = s.scalar(select(A).where(A.board == board, A.task_id == task_id, A.run_id == run_id))
    if existing is not None:
        if existing.ordinal == ordinal and existing.payload_digest == digest:
            return "duplicate"
        raise DuplicateIdentity(
            f"{board}/{task_id} run {run_id} already has row {existing.id} "
            f"on ordinal {existing.ordinal} ({existing.state})"
        )
    row = A(
        board=board,
        task_id=task_id,
        run_id=run_id,
        ordinal=ordinal,
        state=RowState.ASSIGNED.value,
        attempt=1,
        payload=text,
        payload_digest=digest,
        created_at=now,
        updated_at=now,
    )
    try:
        with s.begin_nested():
            s.add(row)
    except exc.IntegrityError as err:
        if "ordinal" in str(err.orig):
            raise OrdinalTaken(f"ordinal {ordinal} already holds a live row") from None
        raise DuplicateIdentity(f"{board}/{task_id} run {run_id} was added concurrently") from None
    return "added"


def offer(s: Session, ordinal: int, *, settings: Settings, now: float) -> Offer | None:
    """Start the lease of the ordinal's ``assigned`` row with a freshly minted fence.

    Nothing to offer (no row, or the row is already running or holds a result)
    gives ``None``. The row keeps its identity across expiries and worker
    restarts, so a restarted worker gets the same run back, under a new fence.
    """
    validate.integer("ordinal", ordinal, 0, settings.pool_size - 1)
    row = s.scalar(select(A).where(A.ordinal == ordinal, A.state == RowState.ASSIGNED.value))
    if row is None:
        return None
    fence = mint_fence(s)
    lease_until = now + settings.lease_seconds
    _guarded(
        s,
        row.id,
        "offer",
        {A.state: RowState.ASSIGNED.value, A.attempt: row.attempt},
        state=RowState.RUNNING.value,
        fence=fence,
        lease_until=lease_until,
        updated_at=now,
    )
    assert row.payload is not None  # a live row always has its payload (CHECK live_has_payload)
    return Offer(
        row.id,
        row.board,
        row.task_id,
        row.run_id,
        row.ordinal,
        row.attempt,
        fence,
        lease_until,
        json.loads(row.payload),
        row.payload_digest,
    )


def mint_fence(s: Session) -> int:
    stmt = (
        update(FenceSequence)
        .where(FenceSequence.id == 1)
        .values(value=FenceSequence.value + 1)
        .returning(FenceSequence.value)
    )
    value = s.execute(stmt).scalar_one_or_none()
    if value is None:
        raise NotFound("the fence sequence row is missing: run `poolctl init`")
    return value


def heartbeat(
    s: Session, env: Envelope, *, settings: Settings, now: float
) -> Literal["applied", "duplicate"]:
    """Extend the lease of the exact attempt and fence the envelope names."""
    if _seen(s, env, "heartbeat"):
        return "duplicate"
    stmt = (
        update(A)
        .where(*_holder_matches(env, now))
        .values(lease_until=now + settings.lease_seconds, updated_at=now)
    )
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        _refuse(s, env, now)
    _record_delivery(s, env, "heartbeat", now)
    return "applied"


def accept_result(s: Session, env: Envelope, *, now: float) -> Literal["applied", "duplicate"]:
    """Store the worker's result; the row moves to ``result`` until the board has it."""
    assert env.result is not None
    if _seen(s, env, "result"):
        return "duplicate"
    result_digest = validate.sha256(env.result)
    row = _row_of(s, env)
    if row is not None and row.result_digest is not None:
        if row.result_digest != result_digest:
            raise DeliveryConflict(f"row {row.id} already has a different result")
        _record_delivery(s, env, "result", now)
        return "duplicate"
    stmt = (
        update(A)
        .where(*_holder_matches(env, now))
        .values(
            state=RowState.RESULT.value,
            result=env.result,
            result_digest=result_digest,
            updated_at=now,
            **_CLEAR_BOOKKEEPING,
        )
    )
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        _refuse(s, env, now)
    _record_delivery(s, env, "result", now)
    return "applied"


class Expiry(NamedTuple):
    state: RowState  # ASSIGNED (re-offered) or LEASE_FAILED
    lease_until: float  # when the fenced-out lease ended


def _expire_statement() -> Any:
    """Built once: the hottest transition in a storm should not rebuild its SQL per row."""
    table = cast(Table, A.__table__)
    t = table.c
    reoffer = t.attempt < bindparam("max_attempts")
    return (
        table.update()
        .where(
            t.id == bindparam("row_id"),
            t.state == RowState.RUNNING.value,
            t.lease_until > 0,
            t.lease_until < bindparam("now"),
        )
        .values(
            state=case((reoffer, RowState.ASSIGNED.value), else_=RowState.LEASE_FAILED.value),
            attempt=case((reoffer, t.attempt + 1), else_=t.attempt),
            updated_at=bindparam("now"),
            **_CLEAR_BOOKKEEPING,
        )
        .returning(t.state, t.lease_until)
    )


_EXPIRE = _expire_statement()


def expire(s: Session | Connection, row_id: int, *, max_attempts: int, now: float) -> Expiry:
    """Fence out a ``running`` row whose lease ended: re-offer it, or ``lease_failed`` at the end.

    One guarded UPDATE: it matches only while the row is ``running`` with an
    ended lease, so a duplicate message or a race with a fresh offer finds nothing.
    The old lease stays on the row (an ``assigned`` row ignores it) for the metrics.
    """
    conn = s.connection() if isinstance(s, Session) else s
    got = conn.execute(_EXPIRE, {"row_id": row_id, "max_attempts": max_attempts, "now": now}).first()
    if got is None:
        raise LostRace(f"expire: row {row_id} is not running with an ended lease")
    return Expiry(RowState(got.state), float(got.lease_until))


def settle(
    s: Session, row_id: int, to: RowState, *, expect_state: str, expect_attempt: int, now: float
) -> None:
    """Make a row terminal on evidence about its exact run, compacting its bulky JSON."""
    if to not in TERMINAL_STATES:
        raise ValueError(f"settle goes to a terminal state, not {to}")
    _guarded(
        s,
        row_id,
        f"settle to {to}",
        {A.state: expect_state, A.attempt: expect_attempt},
        state=to.value,
        payload=None,
        result=None,
        updated_at=now,
        **_CLEAR_BOOKKEEPING,
    )


def collect_garbage(s: Session, *, retention_seconds: float, batch: int, now: float) -> tuple[int, int]:
    """Delete one batch of terminal rows and of delivery records older than the retention."""
    cutoff = now - retention_seconds
    old_rows = (
        select(A.id)
        .where(A.state.in_([t.value for t in TERMINAL_STATES]), A.updated_at < cutoff)
        .limit(batch)
    )
    rows = s.execute(
        delete(A).where(A.id.in_(old_rows)).execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    old_deliveries = select(Delivery.delivery_id).where(Delivery.created_at < cutoff).limit(batch)
    deliveries = s.execute(
        delete(Delivery)
        .where(Delivery.delivery_id.in_(old_deliveries))
        .execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    return int(rows), int(deliveries)


@dataclass(frozen=True)
class Failure:
    failures: int
    quarantined: bool
    next_attempt_at: float
    new_detail: bool  # the error differs from the one already on record: worth a log line


def record_failure(
    s: Session,
    row_id: int,
    error: str,
    *,
    settings: Settings,
    now: float,
    counts: bool = True,
    rng: random.Random | None = None,
) -> Failure:
    """Note a failed maintenance step on one row: backoff with jitter, quarantine at the threshold.

    ``counts=False`` is for transient trouble (busy board, lost connection): it
    delays the row without bringing it nearer quarantine.
    """
    row = get_row(s, row_id)
    error, previous_error = error[:500], row.last_error
    failures = row.failures + 1 if counts else row.failures
    quarantined = failures >= settings.quarantine_after
    delay = settings.quarantine_retry_seconds if quarantined else backoff(max(failures, 1), settings, rng)
    _guarded(
        s,
        row_id,
        "record failure",
        {A.state: row.state, A.failures: row.failures},
        failures=failures,
        last_error=error,
        next_attempt_at=now + delay,
        quarantined=quarantined,
    )
    return Failure(failures, quarantined, now + delay, new_detail=previous_error != error)


def backoff(n: int, settings: Settings, rng: random.Random | None = None) -> float:
    """Exponential backoff for the n-th failure, capped, with "equal jitter" (half fixed, half random)."""
    ceiling = min(settings.backoff_max_seconds, settings.backoff_base_seconds * 2.0 ** min(n - 1, 30))
    return ceiling / 2 + (rng or random).uniform(0, ceiling / 2)


def record_success(s: Session, row_id: int) -> None:
    """End a row's failure streak (a no-op write when there is none)."""
    s.execute(
        update(A)
        .where(A.id == row_id, (A.failures > 0) | A.quarantined | (A.next_attempt_at > 0))
        .values(**_CLEAR_BOOKKEEPING)
    )


def requeue(s: Session, row_id: int) -> Assignment:
    """Operator reset: clear backoff and quarantine so the next scan picks the row up."""
    row = get_row(s, row_id)
    s.execute(update(A).where(A.id == row_id).values(**_CLEAR_BOOKKEEPING))
    return row


def get_row(s: Session, row_id: int) -> Assignment:
    row = s.get(A, row_id, populate_existing=True)
    if row is None:
        raise NotFound(f"row {row_id}: no such row")
    return row


# --- helpers ---------------------------------------------------------------


def _guarded(s: Session, row_id: int, what: str, expect: dict[Any, Any], **values: Any) -> None:
    stmt = update(A).where(A.id == row_id, *[col == val for col, val in expect.items()]).values(**values)
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        raise LostRace(f"{what}: row {row_id} changed under us (expected {_describe(expect)})")


def _describe(expect: dict[Any, Any]) -> str:
    return ", ".join(f"{col.key}={val}" for col, val in expect.items())


def _holder_matches(env: Envelope, now: float) -> list[Any]:
    return [
        A.board == env.board,
        A.task_id == env.task_id,
        A.run_id == env.run_id,
        A.state == RowState.RUNNING.value,
        A.ordinal == env.worker_ordinal,
        A.attempt == env.attempt,
        A.fence == env.fence,
        A.payload_digest == env.payload_digest,
        A.lease_until >= now,
    ]


def _row_of(s: Session, env: Envelope) -> Assignment | None:
    return s.scalar(
        select(A)
        .where(A.board == env.board, A.task_id == env.task_id, A.run_id == env.run_id)
        .execution_options(populate_existing=True)
    )


def _refuse(s: Session, env: Envelope, now: float) -> None:
    """Explain why the holder's guarded update matched nothing, naming the field."""
    row = _row_of(s, env)
    if row is None:
        if s.scalar(select(func.count()).select_from(A).where(A.board == env.board)) == 0:
            raise NotFound(f"board: unknown board {env.board!r}")
        raise NotFound(f"task_id/run_id: no assignment for {env.board}/{env.task_id} run {env.run_id}")
    checks = [
        ("state", row.state == RowState.RUNNING.value, f"row {row.id} is {row.state}, not running"),
        ("worker_ordinal", row.ordinal == env.worker_ordinal, f"the run is on ordinal {row.ordinal}"),
        ("attempt", row.attempt == env.attempt, f"current attempt is {row.attempt}"),
        ("fence", row.fence == env.fence, f"current fence is {row.fence}"),
        ("payload_digest", row.payload_digest == env.payload_digest, "does not match the assignment"),
        ("lease", (row.lease_until or 0) >= now, f"the lease ended at {row.lease_until}"),
    ]
    for field, ok, why in checks:
        if not ok:
            raise StaleHolder(f"{field}: stale holder refused: {why}")
    raise LostRace(f"row {row.id} changed concurrently")


def _seen(s: Session, env: Envelope, kind: str) -> bool:
    known = s.get(Delivery, env.delivery_id)
    if known is None:
        return False
    if known.kind != kind or known.digest != env.digest():
        raise DeliveryConflict(f"delivery_id: {env.delivery_id!r} was already used with other content")
    return True


def _record_delivery(s: Session, env: Envelope, kind: str, now: float) -> None:
    row_id = s.scalar(
        select(A.id).where(A.board == env.board, A.task_id == env.task_id, A.run_id == env.run_id)
    )
    values = {
        "delivery_id": env.delivery_id,
        "assignment_id": row_id or 0,
        "kind": kind,
        "digest": env.digest(),
        "created_at": now,
    }
    dialect = s.get_bind().dialect.name
    insert = postgresql.insert if dialect == "postgresql" else sqlite.insert
    stmt = (
        insert(Delivery)
        .values(**values)
        .on_conflict_do_nothing(index_elements=["delivery_id"])
        .returning(Delivery.delivery_id)
    )
    if s.execute(stmt).scalar_one_or_none() is None:
        raise TransientError(f"delivery_id: {env.delivery_id!r} is being delivered concurrently; retry")

"""The pool worker protocol: offer, heartbeat, result (docs/design.md, "Execution authority").

Each function takes the caller's session (one short transaction), a ``now``
and the values it needs. Only the holder of the current attempt and fence may
write; a delivery replayed with the same id and digest is a duplicate, the
same id with other content a conflict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core import validate
from core.errors import CorruptRow, DeliveryConflict, LostRace, NotFound, StaleHolder, TransientError
from core.retry import RetryPolicy
from store import bookkeeping
from store.envelope import Envelope
from store.models import Assignment, Delivery, FenceSequence, RowState
from store.rows import CLEAR_BOOKKEEPING, get_row, guarded

A = Assignment


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


def offer(s: Session, ordinal: int, *, pool_size: int, lease_seconds: float, now: float) -> Offer | None:
    """Start the lease of the ordinal's ``assigned`` row with a freshly minted fence.

    Nothing to offer (no row, or the row is already running or holds a result)
    gives ``None``. The row keeps its identity across expiries and worker
    restarts, so a restarted worker gets the same run back, under a new fence.
    A row whose stored payload cannot be read back is refused (``CorruptRow``)
    with nothing changed and no fence minted.
    """
    validate.ordinal("ordinal", ordinal, pool_size)
    row = s.scalar(select(A).where(A.ordinal == ordinal, A.state == RowState.ASSIGNED.value))
    if row is None:
        return None
    payload = _stored_payload(row)  # before the fence: a row we cannot hand out is not granted
    fence = mint_fence(s)
    lease_until = now + lease_seconds
    guarded(
        s,
        row.id,
        "offer",
        {A.state: RowState.ASSIGNED.value, A.attempt: row.attempt},
        state=RowState.RUNNING.value,
        fence=fence,
        lease_until=lease_until,
        updated_at=now,
    )
    return Offer(
        row.id,
        row.board,
        row.task_id,
        row.run_id,
        row.ordinal,
        row.attempt,
        fence,
        lease_until,
        payload,
        row.payload_digest,
    )


def _stored_payload(row: Assignment) -> dict[str, Any]:
    """The row's payload, or ``CorruptRow`` if the stored text is not what ``add_run`` wrote."""
    text = row.payload or ""  # a live row always has one (CHECK live_has_payload)
    if validate.sha256(text) != row.payload_digest:
        raise CorruptRow(row.id, "the stored payload does not match its digest; not granted")
    try:
        payload = json.loads(text)
    except (ValueError, RecursionError):
        payload = None
    if not isinstance(payload, dict):
        raise CorruptRow(row.id, "the stored payload is not a JSON object; not granted")
    return payload


def note_corrupt(s: Session, row_id: int, problem: str, *, policy: RetryPolicy, now: float) -> None:
    """Record an unreadable row on itself (backoff, then quarantine) so an operator sees it.

    A worker polls ``offer`` often: only a row whose backoff has run out takes
    another record, so the failure count follows the retry policy, not the poll rate.
    """
    row = get_row(s, row_id)
    if row.state == RowState.ASSIGNED.value and row.next_attempt_at <= now:
        bookkeeping.record_failure(s, row_id, problem, policy=policy, now=now)


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
    s: Session, env: Envelope, *, lease_seconds: float, now: float
) -> Literal["applied", "duplicate"]:
    """Extend the lease of the exact attempt and fence the envelope names."""
    if _seen(s, env, "heartbeat"):
        return "duplicate"
    stmt = (
        update(A)
        .where(*_holder_matches(env, now))
        .values(lease_until=now + lease_seconds, updated_at=now)
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
            **CLEAR_BOOKKEEPING,
        )
    )
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        _refuse(s, env, now)
    _record_delivery(s, env, "result", now)
    return "applied"


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

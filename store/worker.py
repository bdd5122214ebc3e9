"""The pool worker protocol: offer, heartbeat, result, release (docs/design.md, "Execution authority").

Each function takes the caller's session (one short transaction), a ``now``
and the values it needs. Only the holder of the current attempt and fence may
write. Authority is checked before replay: a delivery replayed with the same
id and digest is a duplicate only for the fence that made it, while that
fence is still the row's last word; the same id with other content is a
conflict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from sqlalchemy import func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from core import validate
from core.errors import CorruptRow, DeliveryConflict, LostRace, NotFound, StaleHolder, TransientError
from core.retry import RetryPolicy
from store import bookkeeping, lineage
from store.envelope import Envelope
from store.models import Assignment, Delivery, FenceSequence, RowState
from store.rows import CLEAR_BOOKKEEPING, get_row, guarded

A = Assignment


PROTOCOL_VERSION = 1  # of the grant and envelope shapes; the wire protocol reports it


@dataclass(frozen=True)
class Offer:
    """A grant: an ordinal's run, as handed to the worker instance (``owner``) that asked."""

    row_id: int
    board: str
    task_id: str
    run_id: int
    ordinal: int
    owner: str
    attempt: int
    fence: int
    lease_until: float
    payload: dict[str, Any]
    payload_digest: str
    protocol_version: int = PROTOCOL_VERSION


def offer(
    s: Session, ordinal: int, *, owner: str, pool_size: int, lease_seconds: float, now: float
) -> Offer | None:
    """Grant the ordinal's run to the worker instance ``owner``.

    - ``assigned``: the lease starts under a freshly minted fence.
    - ``running`` with a live lease, asked by another owner: a restarted worker.
      It gets the same run back at once, same attempt, under a new fence and a
      new lease; the old instance is fenced out without burning an attempt.
    - ``running``, asked again by the owner that holds it: the same grant again
      (same fence, same lease), nothing written. A worker that lost the answer
      to its ``offer`` and asks again must not fence itself out, and a second
      fence for the same instance would only invite two loops to run one grant.
    - ``running`` with an ended lease: ``None``. That attempt has failed (its
      heartbeats are already refused); ``expire`` re-offers it at ``attempt+1``
      or parks it ``lease_failed``, so a worker cannot restart its way past
      ``max_attempts``.
    - nothing on the ordinal, or a row holding a result: ``None``.
    - a row whose stored payload cannot be read back: ``CorruptRow``, with nothing
      changed and no fence minted.

    Two live instances asking on one ordinal fence each other out in turn
    (the last to ask holds the run); the ordinal's credential is the
    authority, so only a misconfigured pool runs two.

    A new grant retires every live child of earlier grants in the same
    transaction (a restart's children are never adoptable), so a run and its
    lineage never run as two executions.

    The row is locked first (``FOR UPDATE``; SQLite's ``BEGIN IMMEDIATE``
    already serialises writers), and the grant is one guarded UPDATE on the
    state, attempt and fence just read. A live grant never moves to another
    ordinal: only the row on ``ordinal`` is ever considered.
    """
    validate.ordinal("ordinal", ordinal, pool_size)
    validate.name("owner", owner, 128)
    row = s.scalar(
        select(A)
        .where(A.ordinal == ordinal, A.state.in_([RowState.ASSIGNED.value, RowState.RUNNING.value]))
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    if row is None:
        return None
    payload = _stored_payload(row)  # before any fence: a row we cannot hand out is not granted
    if row.state == RowState.RUNNING.value:
        assert row.fence is not None and row.lease_until is not None  # CHECK running_has_lease
        if row.lease_until < now:
            return None
        if row.owner == owner:
            return _grant(row, owner, row.fence, row.lease_until, payload)
    lineage.retire_children(s, [row.id], now)
    fence = mint_fence(s)
    lease_until = now + lease_seconds
    guarded(
        s,
        row.id,
        "offer",
        {A.state: row.state, A.attempt: row.attempt, A.fence: row.fence},
        state=RowState.RUNNING.value,
        owner=owner,
        fence=fence,
        lease_until=lease_until,
        updated_at=now,
    )
    return _grant(row, owner, fence, lease_until, payload)


def _grant(row: Assignment, owner: str, fence: int, lease_until: float, payload: dict[str, Any]) -> Offer:
    return Offer(
        row_id=row.id,
        board=row.board,
        task_id=row.task_id,
        run_id=row.run_id,
        ordinal=row.ordinal,
        owner=owner,
        attempt=row.attempt,
        fence=fence,
        lease_until=lease_until,
        payload=payload,
        payload_digest=row.payload_digest,
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
    row, seen = _admit(s, env, "heartbeat", now)
    if seen:
        return "duplicate"
    if row.state != RowState.RUNNING.value:  # the holder of the row's result sends no new heartbeats
        raise StaleHolder(f"state: stale holder refused: row {row.id} is {row.state}, not running")
    _apply(s, env, now, lease_until=now + lease_seconds, updated_at=now)
    _record_delivery(s, row.id, env, "heartbeat", now)
    return "applied"


def accept_result(s: Session, env: Envelope, *, now: float) -> Literal["applied", "duplicate"]:
    """Store the worker's result; the row moves to ``result`` until the board has it.

    The holder that delivered the row's result may deliver it again under a new
    delivery id (a retry after a lost answer): ``duplicate``, recorded; other
    content is a ``DeliveryConflict``.
    """
    assert env.result is not None
    row, seen = _admit(s, env, "result", now)
    if seen:
        return "duplicate"
    result_digest = validate.sha256(env.result)
    if row.result_digest is not None:
        if row.result_digest != result_digest:
            raise DeliveryConflict(f"payload: row {row.id} already has a different result")
        _record_delivery(s, row.id, env, "result", now)
        return "duplicate"
    _apply(
        s,
        env,
        now,
        state=RowState.RESULT.value,
        result=env.result,
        result_digest=result_digest,
        updated_at=now,
        **CLEAR_BOOKKEEPING,
    )
    lineage.retire_children(s, [row.id], now)
    _record_delivery(s, row.id, env, "result", now)
    return "applied"


def release(
    s: Session, env: Envelope, *, max_attempts: int, now: float
) -> Literal["reoffered", "lease_failed", "duplicate"]:
    """The holder hands its run back: re-offered at once (``attempt+1``), or ``lease_failed`` at the last.

    Only the current holder (running, live lease, same attempt and fence) may
    release. Its replay stays a ``duplicate`` until the run is granted again
    under a newer fence; after that the old fence is refused like any other.
    """
    row, seen = _admit(s, env, "release", now)
    if seen:
        return "duplicate"
    if row.state != RowState.RUNNING.value:  # a row holding a result is the results pass's now
        raise StaleHolder(f"state: stale holder refused: row {row.id} is {row.state}, not running")
    last = row.attempt >= max_attempts
    _apply(
        s,
        env,
        now,
        state=RowState.LEASE_FAILED.value if last else RowState.ASSIGNED.value,
        attempt=row.attempt if last else row.attempt + 1,
        lease_until=now,
        updated_at=now,
        **CLEAR_BOOKKEEPING,
    )
    lineage.retire_children(s, [row.id], now)
    _record_delivery(s, row.id, env, "release", now)
    return "lease_failed" if last else "reoffered"


def _admit(s: Session, env: Envelope, kind: str, now: float) -> tuple[Assignment, bool]:
    """Check before replay: lock the run's row, check the sender's authority, then the delivery id.

    Returns the locked row and whether the delivery is a replay (``duplicate``).
    Authority, in order:
    - ``running``: the holder of the current attempt, fence and live lease;
    - a row holding a result (``result``, or terminal with its digest kept):
      the fence that delivered it, for its own replays and its result again;
    - a row its holder released: that fence, for the replay of its release,
      until a newer fence is granted.
    Anyone else is refused as a ``StaleHolder`` naming the first field that
    differs, before the delivery id is looked at, so nothing from a stale fence
    is ever recorded or called a duplicate.

    Locking first makes a concurrent replay wait for the delivery being applied
    and then find it: ``duplicate`` on every backend (PostgreSQL ``FOR UPDATE``;
    SQLite's ``BEGIN IMMEDIATE`` already serialises writers).
    """
    row = s.scalar(
        select(A)
        .where(A.board == env.board, A.task_id == env.task_id, A.run_id == env.run_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    if row is None:
        if s.scalar(select(func.count()).select_from(A).where(A.board == env.board)) == 0:
            raise NotFound(f"board: unknown board {env.board!r}")
        raise NotFound(f"task_id/run_id: no assignment for {env.board}/{env.task_id} run {env.run_id}")
    if row.state == RowState.RUNNING.value:
        _check_holder(row, env, now, lease=True)
    elif row.result_digest is not None:
        _check_holder(row, env, now, lease=False)
    elif kind == "release" and row.fence == env.fence and _released_by(s, env):
        return row, True
    else:
        _stale("state", f"row {row.id} is {row.state}, not running")
    return row, _seen(s, env, kind)


def _released_by(s: Session, env: Envelope) -> bool:
    known = s.get(Delivery, env.delivery_id)
    return known is not None and known.kind == "release" and known.digest == env.digest()


def _check_holder(row: Assignment, env: Envelope, now: float, *, lease: bool) -> None:
    checks = [
        ("worker_ordinal", row.ordinal == env.worker_ordinal, f"the run is on ordinal {row.ordinal}"),
        ("attempt", row.attempt == env.attempt, f"current attempt is {row.attempt}"),
        ("fence", row.fence == env.fence, f"current fence is {row.fence}"),
        ("payload_digest", row.payload_digest == env.payload_digest, "does not match the assignment"),
        ("lease", not lease or (row.lease_until or 0) >= now, f"the lease ended at {row.lease_until}"),
    ]
    for field, ok, why in checks:
        if not ok:
            _stale(field, why)


def _stale(field: str, why: str) -> NoReturn:
    raise StaleHolder(f"{field}: stale holder refused: {why}")


def _apply(s: Session, env: Envelope, now: float, **values: Any) -> None:
    """The holder's write: one UPDATE guarded on the whole holder identity, its result checked."""
    stmt = update(A).where(*_holder_matches(env, now)).values(**values)
    if s.execute(stmt).rowcount != 1:  # type: ignore[attr-defined]
        raise LostRace(f"{env.board}/{env.task_id} run {env.run_id} changed concurrently")


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


def _seen(s: Session, env: Envelope, kind: str) -> bool:
    known = s.get(Delivery, env.delivery_id)
    if known is None:
        return False
    if known.kind != kind or known.digest != env.digest():
        raise DeliveryConflict(f"delivery_id: {env.delivery_id!r} was already used with other content")
    return True


def _record_delivery(s: Session, row_id: int, env: Envelope, kind: str, now: float) -> None:
    values = {
        "delivery_id": env.delivery_id,
        "assignment_id": row_id,
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

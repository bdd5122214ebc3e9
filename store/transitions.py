"""The maintenance transitions: add a claimed run, expire a lease, settle, collect, requeue.

Each function takes the caller's session (one short transaction), a ``now``
(epoch seconds) and the values it needs; none opens a transaction of its own.
Each is one guarded UPDATE that raises ``LostRace`` when it matches nothing;
nothing is ever written blind after a read (docs/design.md, "Transitions").
A transition that ends a grant retires the run's live children in the same
transaction (``store.lineage.retire_children``; docs/design.md, "Lineage").
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple, cast

from sqlalchemy import Connection, Table, bindparam, case, delete, exc, select
from sqlalchemy.orm import Session

from core import validate
from core.errors import DuplicateIdentity, InvalidInput, LostRace, NotFound, OrdinalTaken
from store import lineage
from store.models import TERMINAL_STATES, Assignment, ChildExecution, Delivery, RowState
from store.rows import CLEAR_BOOKKEEPING, guarded

A = Assignment
TERMINAL_VALUES = frozenset(t.value for t in TERMINAL_STATES)


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
            **CLEAR_BOOKKEEPING,
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
    lineage.retire_children(conn, [row_id], now)
    return Expiry(RowState(got.state), float(got.lease_until))


def settle(
    s: Session, row_id: int, to: RowState, *, expect_state: str, expect_attempt: int, now: float
) -> None:
    """Make a row terminal on evidence about its exact run, compacting its bulky JSON."""
    if to not in TERMINAL_STATES:
        raise ValueError(f"settle goes to a terminal state, not {to}")
    guarded(
        s,
        row_id,
        f"settle to {to}",
        {A.state: expect_state, A.attempt: expect_attempt},
        state=to.value,
        payload=None,
        result=None,
        updated_at=now,
        **CLEAR_BOOKKEEPING,
    )
    lineage.retire_children(s, [row_id], now)


def collect_garbage(s: Session, *, retention_seconds: float, batch: int, now: float) -> tuple[int, int]:
    """Delete one batch of terminal rows (with their child executions) and of old delivery records.

    The batch's row ids are read first so the children deleted are exactly those
    of the rows deleted (the foreign key refuses a row whose children remain).
    """
    cutoff = now - retention_seconds
    old = (A.state.in_([t.value for t in TERMINAL_STATES]), A.updated_at < cutoff)
    ids = list(s.scalars(select(A.id).where(*old).order_by(A.id).limit(batch)))
    rows = 0
    if ids:
        s.execute(
            delete(ChildExecution)
            .where(ChildExecution.row_id.in_(ids))
            .execution_options(synchronize_session=False)
        )
        rows = s.execute(
            delete(A).where(A.id.in_(ids), *old).execution_options(synchronize_session=False)
        ).rowcount  # type: ignore[attr-defined]
    old_deliveries = select(Delivery.delivery_id).where(Delivery.created_at < cutoff).limit(batch)
    deliveries = s.execute(
        delete(Delivery)
        .where(Delivery.delivery_id.in_(old_deliveries))
        .execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    return int(rows), int(deliveries)


def requeue(s: Session, row_id: int, *, now: float) -> Assignment:
    """Operator reset: clear backoff and quarantine so the next scan picks the row up now.

    A terminal row is never retried, and a row with a live child execution is
    not reset: refused, nothing changes. Its ``unknown`` children (their worker
    vanished) are discarded, never replayed. The row is locked first, so no
    child registers between the check and the reset.
    """
    row = s.get(A, row_id, populate_existing=True, with_for_update=True)
    if row is None:
        raise NotFound(f"row {row_id}: no such row")
    if row.state in TERMINAL_VALUES:
        raise InvalidInput("row", f"row {row_id} is {row.state}: a terminal row is never retried")
    lineage.reset(s, row_id, now=now)
    guarded(s, row_id, "requeue", {A.state: row.state, A.attempt: row.attempt}, **CLEAR_BOOKKEEPING)
    return row

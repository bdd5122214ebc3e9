"""The maintenance transitions: add a claimed run, expire a lease, settle, collect, requeue.

``settle_run`` settles a row by its run's identity, for an operator's word
about that exact run (a cancelled or abandoned run).

Each function takes the caller's session (one short transaction), a ``now``
(epoch seconds) and the values it needs; none opens a transaction of its own.
Each is one guarded UPDATE that raises ``LostRace`` when it matches nothing;
nothing is ever written blind after a read (docs/design.md, "Transitions").
A transition that ends a grant retires the run's live children in the same
transaction (``store.lineage.retire_children``; docs/design.md, "Lineage").

Each transition that happens appends one audit event in its transaction
(``store.audit``; docs/design.md, "Audit trail"), naming its ``actor``
(``audit.by_pass``, ``audit.OPERATOR``); one that raises appends none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, NamedTuple

from sqlalchemy import Connection, delete, exc, or_, select
from sqlalchemy.orm import Session

from core import db, shapes, tracing, validate
from core.errors import DuplicateIdentity, InvalidInput, OrdinalTaken
from core.isolate import isolate
from store import audit, lineage
from store.models import TERMINAL_STATES, Assignment, ChildExecution, Delivery, EventKind, RowState
from store.rows import CLEAR_BOOKKEEPING, get_row, guarded

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
    actor: str = audit.UNATTRIBUTED,
    traceparent: str | None = None,
    ready_at: float | None = None,
) -> Literal["added", "duplicate"]:
    """Record a claimed board run on a free ordinal, attempt 1, state ``assigned``; ``ready_at`` is when
    the board says the task turned ready (``store.trends``' wait runs from it to ``now``).

    An identical duplicate (same identity, ordinal and payload) of a row that
    is not terminal is a no-op; a conflicting one, an identity that already
    ended (board run ids never repeat, so this is a reused id, never a
    duplicate), or an ordinal that holds a live row, is a ``ProtocolError``.
    """
    validate.name("board", board, shapes.BOARD_CHARS)
    validate.name("task_id", task_id, shapes.TASK_ID_CHARS)
    validate.integer("run_id", run_id, *shapes.RUN_ID)
    validate.ordinal("ordinal", ordinal, pool_size)
    text = validate.document("payload", payload)
    digest = validate.sha256(text)
    existing = s.scalar(select(A).where(A.board == board, A.task_id == task_id, A.run_id == run_id))
    if existing is not None:
        if existing.state in TERMINAL_VALUES:
            raise DuplicateIdentity(
                f"{board}/{task_id} run {run_id} already ended as row {existing.id} ({existing.state}): "
                "a run id was reused; refused"
            )
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
        ready_at=ready_at,
        traceparent=tracing.valid(traceparent),  # from a message: a malformed one is dropped, not stored
    )
    try:
        with s.begin_nested():
            s.add(row)
    except exc.IntegrityError as err:
        if "ordinal" in str(err.orig):
            raise OrdinalTaken(f"ordinal {ordinal} already holds a live row") from None
        raise DuplicateIdentity(f"{board}/{task_id} run {run_id} was added concurrently") from None
    claimed = f"{board}/{task_id} run {run_id} on ordinal {ordinal}"
    audit.append(s, [audit.Event(row.id, EventKind.CLAIM, actor, None, row.state, 1, None, claimed)], now=now)
    return "added"


class Expiry(NamedTuple):
    state: RowState  # ASSIGNED (re-offered) or LEASE_FAILED
    lease_until: float  # when the fenced-out lease ended


# The hottest transition of a storm, written once as SQL and run on the driver's own
# cursor: through the SQL layer, the per-value processing of a 1,000-id IN list and
# the wrapping of every failed statement cost several times the database's own work.
_EXPIRE_SQL = (
    "UPDATE assignments SET"
    f" state = CASE WHEN attempt < {{p}} THEN '{RowState.ASSIGNED}' ELSE '{RowState.LEASE_FAILED}' END,"
    " attempt = CASE WHEN attempt < {p} THEN attempt + 1 ELSE attempt END,"
    # progress clears the failure streak, as CLEAR_BOOKKEEPING does for the other transitions
    " updated_at = {p}, failures = 0, last_error = NULL, next_attempt_at = 0, quarantined = false"
    f" WHERE id {{among}} AND {{state}} = '{RowState.RUNNING}' AND lease_until > 0 AND lease_until < {{p}}"
    " RETURNING id, state, lease_until{also}"
)
# On PostgreSQL the moved rows' events are written by the same statement, from what the
# UPDATE returns: one round trip and no second lookup of the batch's rows.
_EXPIRE_LOGGED_SQL = "WITH moved AS ({update}), logged AS ({insert}) SELECT id, state, lease_until FROM moved"
_STATE = {state.value: state for state in RowState}  # a dict lookup per row, not an enum call
# SQLite would plan even a 4-id set through ix_assignments_state_due, reading every running
# row (0.6 ms a statement at 10k rows, which the runner's splitting of a poisoned batch
# multiplies); unary + keeps it on the primary key. PostgreSQL plans it well as written.
_STATE_TERM = {"sqlite": "+state"}


class Expired(NamedTuple):
    moved: dict[int, Expiry]  # the rows fenced out
    refused: dict[int, Exception]  # the rows the database would not change, with its error


def expire_many(
    s: Session | Connection,
    row_ids: Sequence[int],
    *,
    max_attempts: int,
    now: float,
    actor: str = audit.UNATTRIBUTED,
) -> Expired:
    """Fence out the ``running`` rows among ``row_ids`` whose lease ended: one guarded UPDATE.

    Each row is re-offered (``assigned``, attempt + 1) or, at the last attempt,
    ``lease_failed``. The statement matches a row only while it is ``running``
    with an ended lease, so a duplicate message or a race with a fresh offer
    finds nothing: a row in neither half of the answer lost its race. Where the
    database refuses the statement for a row's sake, it runs again in parts, each
    under a savepoint, until the refused rows stand alone (``core.isolate``): they
    come back unchanged with their errors, and the others move. The old lease
    stays on the row (an ``assigned`` row ignores it) for the metrics. The moved
    rows' events are one more statement (``audit.expired``; on PostgreSQL part of the
    UPDATE itself), never one per row or per part, and so is their children's retirement.
    """
    if not row_ids:
        return Expired({}, {})
    conn = db.connection_of(s)
    p = db.placeholder(conn)
    state = _STATE_TERM.get(conn.dialect.name, "state")
    logged = conn.dialect.name == "postgresql"
    before = (max_attempts, max_attempts, now)
    after: tuple[Any, ...] = (now, *audit.expired_params(actor, now)) if logged else (now,)

    def attempt(part: Sequence[int]) -> list[Any]:
        among, ids = db.among(conn, part)
        sql = _EXPIRE_SQL.format(p=p, among=among, state=state, also=", attempt, fence" if logged else "")
        if logged:
            sql = _EXPIRE_LOGGED_SQL.format(update=sql, insert=audit.expired_from("moved", p))
        return db.raw_alone(conn, sql, (*before, *ids, *after))

    parts, refused = isolate(row_ids, attempt, goes_up=_not_a_refusal)
    got = [row for part in parts for row in part]
    expired = [row_id for row_id, _, _ in got]
    if not logged:
        audit.expired(conn, expired, actor=actor, now=now)  # same transaction, as is what follows
    lineage.retire_children(conn, expired, now, actor=actor)
    moved = {row_id: Expiry(_STATE[state], lease_until) for row_id, state, lease_until in got}
    return Expired(moved, dict(refused))


def _not_a_refusal(err: BaseException) -> bool:
    """Only the database refusing a row is that row's: anything else (a busy store, the
    worker's time limit, a bug) ends the whole search."""
    return not isinstance(err, exc.DBAPIError) or db.is_transient(err)


def settle(
    s: Session,
    row_id: int,
    to: RowState,
    *,
    expect_state: str,
    expect_attempt: int,
    now: float,
    actor: str = audit.UNATTRIBUTED,
    evidence: str | None = None,
    kind: EventKind = EventKind.SETTLE,
) -> None:
    """Make a row terminal on evidence about its exact run, compacting its bulky JSON.

    Its event is a ``settle`` with the ``evidence`` as detail, or the more
    specific ``kind`` the caller names (an operator's ``abandon`` or ``cancel``).
    """
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
    audit.observed(s, kind, [(row_id, expect_state, evidence)], actor=actor, now=now)
    lineage.retire_children(s, [row_id], now, actor=actor)


class Settled(NamedTuple):
    row_id: int
    ordinal: int
    was: str  # the state the row left
    attempt: int


def settle_run(
    s: Session,
    *,
    board: str,
    task_id: str,
    run_id: int,
    to: RowState,
    states: Iterable[RowState],
    now: float,
    actor: str = audit.UNATTRIBUTED,
    evidence: str | None = None,
    kind: EventKind = EventKind.SETTLE,
) -> Settled | None:
    """Settle the run's row, if it is in one of ``states``; None if it has no such row.

    For evidence about the exact run rather than one attempt of it (the board
    cancelled or parked that run): the row is read with a row lock (``FOR
    UPDATE``; SQLite's ``BEGIN IMMEDIATE`` already excludes other writers),
    then ``settle`` is guarded on the state and attempt read, so a holder's
    concurrent write either lands first or is refused after.
    """
    wanted = {state.value for state in states}
    row = s.scalar(
        select(A)
        .where(A.board == board, A.task_id == task_id, A.run_id == run_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    )
    if row is None or row.state not in wanted:
        return None
    settled = Settled(row.id, row.ordinal, row.state, row.attempt)
    settle(
        s,
        row.id,
        to,
        expect_state=settled.was,
        expect_attempt=settled.attempt,
        now=now,
        actor=actor,
        evidence=evidence,
        kind=kind,
    )
    return settled


def collect_garbage(s: Session, *, retention_seconds: float, batch: int, now: float) -> tuple[int, int]:
    """Delete one batch of terminal rows (with their child executions) and of old delivery records
    (a row still live or in lease_failed keeps its result and release records however old).

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
    unsettled = select(A.id).where(
        A.id == Delivery.assignment_id, A.state.not_in([t.value for t in TERMINAL_STATES])
    )
    # A row not yet settled keeps its result and release records, so a replay of them is still
    # answered; its heartbeats' go by age (a heartbeat's replay is retried in seconds, not a week).
    kept = or_(Delivery.kind == "heartbeat", ~unsettled.exists())
    old_deliveries = select(Delivery.delivery_id).where(Delivery.created_at < cutoff, kept).limit(batch)
    deliveries = s.execute(
        delete(Delivery)
        .where(Delivery.delivery_id.in_(old_deliveries))
        .execution_options(synchronize_session=False)
    ).rowcount  # type: ignore[attr-defined]
    return int(rows), int(deliveries)


def requeue(
    s: Session, row_id: int, *, now: float, actor: str = audit.UNATTRIBUTED, reason: str = ""
) -> Assignment:
    """Operator reset: clear backoff and quarantine so the next scan picks the row up now.

    A terminal row is never retried, and a row with a live child execution is
    not reset: refused, nothing changes. Its ``unknown`` children (their worker
    vanished) are discarded, never replayed. The row is locked first, so no
    child registers between the check and the reset. The operator's ``reason``,
    when given, leads the event's detail.
    """
    row = get_row(s, row_id, for_update=True)
    if row.state in TERMINAL_VALUES:
        raise InvalidInput("row", f"row {row_id} is {row.state}: a terminal row is never retried")
    cleared = f"cleared {row.failures} failure(s)" + (" and quarantine" if row.quarantined else "")
    cleared = f"{reason}: {cleared}" if reason else cleared
    event = audit.Event(
        row_id, EventKind.REQUEUE, actor, row.state, row.state, row.attempt, row.fence, cleared
    )
    discarded = lineage.reset(s, row_id, now=now)
    guarded(s, row_id, "requeue", {A.state: row.state, A.attempt: row.attempt}, **CLEAR_BOOKKEEPING)
    if discarded:
        event = event._replace(detail=f"{cleared}; discarded {discarded} unknown child execution(s)")
    audit.append(s, [event], now=now)
    return row

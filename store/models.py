"""The pool store schema: states live in the schema, not only in Python.

``RowState`` is stored by value; a CHECK lists the states, further CHECKs tie
columns to states (a running row has a lease and a fence, a terminal row has
its bulky JSON compacted away), and a partial UNIQUE index makes "at most one
live row per ordinal" a database fact. Partial indexes serve the scanners.
"""

from __future__ import annotations

from enum import StrEnum

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeEngine

from core import shapes, tracing


class RowState(StrEnum):
    ASSIGNED = "assigned"
    RUNNING = "running"
    RESULT = "result"
    LEASE_FAILED = "lease_failed"
    FINALIZED = "finalized"
    STALE = "stale"


LIVE_STATES = (RowState.ASSIGNED, RowState.RUNNING, RowState.RESULT)
TERMINAL_STATES = (RowState.FINALIZED, RowState.STALE)


def _sql_list(states: tuple[RowState, ...] | list[RowState]) -> str:
    return ", ".join(f"'{s.value}'" for s in states)


LIVE_SQL = f"state IN ({_sql_list(LIVE_STATES)})"
TERMINAL_SQL = f"state IN ({_sql_list(TERMINAL_STATES)})"
STATE_CHECK_SQL = f"state IN ({_sql_list(list(RowState))})"
DELIVERY_KINDS = ("heartbeat", "result", "release")
DELIVERY_KINDS_SQL = ", ".join(f"'{k}'" for k in DELIVERY_KINDS)


class ChildStatus(StrEnum):
    """A child execution's status (docs/design.md, "Lineage")."""

    REGISTERED = "registered"  # its parent's holder registered it; it has not reported yet
    RUNNING = "running"  # it has heartbeated
    TERMINAL = "terminal"  # done, retired with its parent's grant, or discarded; receipt compacted
    UNKNOWN = "unknown"  # its worker vanished; discarded on an explicit reset, never resumed


class ChildOutcome(StrEnum):
    """Why a child is terminal."""

    DONE = "done"  # it delivered its own result
    RETIRED = "retired"  # its parent's grant (or its parent child) ended first
    DISCARDED = "discarded"  # it was `unknown` and an operator reset its row


LIVE_CHILD_STATUSES = (ChildStatus.REGISTERED, ChildStatus.RUNNING)
LIVE_CHILD_SQL = "status IN ('registered', 'running')"
CHILD_STATUS_CHECK_SQL = "status IN (" + ", ".join(f"'{s.value}'" for s in ChildStatus) + ")"
CHILD_OUTCOME_CHECK_SQL = "outcome IN (" + ", ".join(f"'{o.value}'" for o in ChildOutcome) + ")"
# Ids grow by "/child:" + 12 hex digits per level: room for 64 levels under "run:<row id>".
MAX_LINEAGE_DEPTH = 64
CHILD_ID_LENGTH = 1280
# Descendants are found by a prefix range on the primary key, so ids must sort bytewise:
# SQLite's default BINARY collation does; PostgreSQL needs "C" (a locale collation would not).


def _child_id() -> TypeEngine[str]:
    return String(CHILD_ID_LENGTH).with_variant(String(CHILD_ID_LENGTH, collation="C"), "postgresql")


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_name)s",
            "uq": "uq_%(table_name)s_%(column_0_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


class Assignment(Base):
    """One claimed board run: which ordinal holds it, under which lease and fence."""

    __tablename__ = "assignments"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    board: Mapped[str] = mapped_column(String(shapes.BOARD_CHARS))
    task_id: Mapped[str] = mapped_column(String(shapes.TASK_ID_CHARS))
    run_id: Mapped[int] = mapped_column(BigInteger)
    ordinal: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    fence: Mapped[int | None] = mapped_column(BigInteger)
    owner: Mapped[str | None] = mapped_column(
        String(shapes.OWNER_CHARS)
    )  # the worker instance of the last grant
    lease_until: Mapped[float | None] = mapped_column(Float)
    payload: Mapped[str | None] = mapped_column(Text)
    payload_digest: Mapped[str] = mapped_column(String(64))
    result: Mapped[str | None] = mapped_column(Text)
    result_digest: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)  # the claim: materialize recorded it here
    updated_at: Mapped[float] = mapped_column(Float)
    # when the board says the task turned ready for this run (its wait ends at ``created_at``);
    # null when the board does not say
    ready_at: Mapped[float | None] = mapped_column(Float)
    # maintenance bookkeeping: durable backoff and quarantine
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    next_attempt_at: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    quarantined: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # the run's trace (core.tracing), for the passes a beat scan starts later; null when tracing is off
    traceparent: Mapped[str | None] = mapped_column(String(tracing.TRACEPARENT_CHARS))

    __table_args__ = (
        UniqueConstraint("board", "task_id", "run_id", name="uq_assignments_identity"),
        CheckConstraint(STATE_CHECK_SQL, name="state"),
        CheckConstraint("attempt >= 1", name="attempt"),
        CheckConstraint("ordinal >= 0", name="ordinal"),
        CheckConstraint("run_id >= 1", name="run_id"),
        CheckConstraint("failures >= 0", name="failures"),
        CheckConstraint(
            "state <> 'running' OR (lease_until IS NOT NULL AND fence IS NOT NULL)",
            name="running_has_lease",
        ),
        CheckConstraint("state <> 'result' OR result_digest IS NOT NULL", name="result_has_digest"),
        CheckConstraint(f"({TERMINAL_SQL}) OR payload IS NOT NULL", name="live_has_payload"),
        CheckConstraint(
            f"NOT ({TERMINAL_SQL}) OR (payload IS NULL AND result IS NULL)",
            name="terminal_compacted",
        ),
        Index(
            "ux_assignments_live_ordinal",
            "ordinal",
            unique=True,
            sqlite_where=text(LIVE_SQL),
            postgresql_where=text(LIVE_SQL),
        ),
        Index(
            "ix_assignments_running_lease",
            "lease_until",
            sqlite_where=text("state = 'running'"),
            postgresql_where=text("state = 'running'"),
        ),
        Index("ix_assignments_state_due", "state", "next_attempt_at"),
        Index(
            "ix_assignments_terminal_age",
            "updated_at",
            sqlite_where=text(TERMINAL_SQL),
            postgresql_where=text(TERMINAL_SQL),
        ),
        Index("ix_assignments_board_state", "board", "state"),
        # Row ids name rows in logs, locks and `poolctl requeue`: never reuse one after GC.
        {"sqlite_autoincrement": True},
    )


class Delivery(Base):
    """One accepted heartbeat, result or release, by delivery id: makes replays idempotent."""

    __tablename__ = "deliveries"

    delivery_id: Mapped[str] = mapped_column(String(shapes.DELIVERY_ID_CHARS), primary_key=True)
    assignment_id: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float, index=True)

    __table_args__ = (CheckConstraint(f"kind IN ({DELIVERY_KINDS_SQL})", name="kind"),)


class ChildExecution(Base):
    """A child execution registered under a run's grant (docs/design.md, "Lineage").

    ``id`` is ``run:<row id>`` for the run itself (never stored), and the
    parent's id + ``/child:`` + 12 random hex digits for a child, so every
    descendant of an execution lies in one primary-key range.
    """

    __tablename__ = "child_executions"

    id: Mapped[str] = mapped_column(_child_id(), primary_key=True)
    row_id: Mapped[int] = mapped_column(Integer, ForeignKey("assignments.id", name="fk_child_executions_row"))
    parent_id: Mapped[str] = mapped_column(_child_id())  # ``run:<row id>`` or a child's id
    status: Mapped[str] = mapped_column(String(16))
    outcome: Mapped[str | None] = mapped_column(String(16))  # set exactly when terminal
    epoch: Mapped[int] = mapped_column(BigInteger)  # the parent grant's fence at registration
    depth: Mapped[int] = mapped_column(Integer)  # 1 for a child of the run
    receipt: Mapped[str | None] = mapped_column(Text)  # latest reported JSON; NULL once terminal
    receipt_digest: Mapped[str | None] = mapped_column(String(64))
    result_digest: Mapped[str | None] = mapped_column(String(64))  # its own result, when it sent one
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)

    __table_args__ = (
        CheckConstraint(CHILD_STATUS_CHECK_SQL, name="status"),
        CheckConstraint(CHILD_OUTCOME_CHECK_SQL, name="outcome"),
        CheckConstraint("depth >= 1", name="depth"),
        CheckConstraint("(status = 'terminal') = (outcome IS NOT NULL)", name="terminal_has_outcome"),
        CheckConstraint("status <> 'terminal' OR receipt IS NULL", name="terminal_compacted"),
        CheckConstraint("receipt IS NULL OR receipt_digest IS NOT NULL", name="receipt_has_digest"),
        CheckConstraint(
            "outcome IS NULL OR outcome <> 'done' OR result_digest IS NOT NULL", name="done_has_digest"
        ),
        # Retiring a row's children, and GC removing them, probe by row; the no-child case is one probe.
        Index("ix_child_executions_row_id", "row_id"),
    )


class EventKind(StrEnum):
    """What an audit event records (docs/design.md, "Audit trail")."""

    CLAIM = "claim"  # a board run was recorded on an ordinal
    GRANT = "grant"  # a worker instance took the run under a new fence
    EXPIRY = "expiry"  # the lease ended: re-offered or lease_failed
    RESULT = "result"  # the holder delivered the run's result
    RELEASE = "release"  # the holder handed the run back
    SETTLE = "settle"  # the run turned terminal: finalized or stale, on evidence
    REQUEUE = "requeue"  # an operator cleared backoff and quarantine
    ABANDON = "abandon"  # an operator gave the run up
    CANCEL = "cancel"  # an operator cancelled the board task
    FAILURE = "failure"  # a maintenance step failed on the row (backoff)
    QUARANTINE = "quarantine"  # the failure that reached the threshold
    CHILDREN_RETIRED = "children_retired"  # the grant's end retired live child executions
    PAUSE = "pause"  # an operator paused dispatch (pool-wide: row id 0, ``audit.POOL``)
    RESUME = "resume"  # an operator resumed dispatch (pool-wide)


EVENT_KIND_CHECK_SQL = "kind IN (" + ", ".join(f"'{k.value}'" for k in EventKind) + ")"


class AuditEvent(Base):
    """One transition of one row, appended in the transaction that made it; kept for the retention period.

    No foreign key: GC removes events by age, in batches, independently of rows.
    """

    __tablename__ = "audit_events"

    id: Mapped[int] = mapped_column(
        BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True
    )
    row_id: Mapped[int] = mapped_column(Integer)
    at: Mapped[float] = mapped_column(Float)
    kind: Mapped[str] = mapped_column(String(24))
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str | None] = mapped_column(String(16))
    attempt: Mapped[int | None] = mapped_column(Integer)
    fence: Mapped[int | None] = mapped_column(BigInteger)
    actor: Mapped[str] = mapped_column(String(64))  # "pass:<name>", "worker:<ordinal>" or "operator"
    detail: Mapped[str | None] = mapped_column(Text)  # reason or evidence, bounded

    __table_args__ = (
        CheckConstraint(EVENT_KIND_CHECK_SQL, name="kind"),
        Index("ix_audit_events_row_id", "row_id", "id"),
        # Neither an index on ``at`` nor SQLite's AUTOINCREMENT (a sqlite_sequence write per
        # insert): GC collects the head of the id order (store.audit.collect), and every
        # transition pays for what the table keeps (bench/store_bench.py, audit cost).
    )


class FenceSequence(Base):
    """A single row holding the last fence minted, store-wide and monotonic."""

    __tablename__ = "fence_sequence"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)


class Call(StrEnum):
    """The worker calls that say an ordinal's worker is there (``OrdinalPresence.call``)."""

    OFFER = "offer"
    HEARTBEAT = "heartbeat"
    RESULT = "result"


CALL_CHECK_SQL = "call IN (" + ", ".join(f"'{c.value}'" for c in Call) + ")"


class OrdinalPresence(Base):
    """The last worker call seen on each ordinal, and the instance that made it.

    Written by the worker calls themselves (``store.presence.note``), at most once per
    ``presence.EVERY_SECONDS`` per ordinal and store handle, so a polling worker costs a
    skipped statement, not a write; a result, which changes its row anyway, always writes.
    """

    __tablename__ = "ordinal_presence"

    ordinal: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    owner: Mapped[str | None] = mapped_column(
        String(shapes.OWNER_CHARS)
    )  # the worker instance, when the call names one
    call: Mapped[str] = mapped_column(String(16))
    at: Mapped[float] = mapped_column(Float)

    __table_args__ = (CheckConstraint(CALL_CHECK_SQL, name="call"),)


class DispatchPause(Base):
    """Whether dispatch is paused (drain mode): one row, with the operator's reason, who and since when.

    While paused, dispatch claims nothing new from the board; everything already claimed
    runs and is maintained as ever (``store.pause``; docs/design.md, "Pause").
    """

    __tablename__ = "dispatch_pause"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    paused: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    reason: Mapped[str | None] = mapped_column(Text)
    actor: Mapped[str | None] = mapped_column(String(64))
    since: Mapped[float | None] = mapped_column(Float)  # when it was paused (or last resumed)

    __table_args__ = (
        CheckConstraint("id = 1", name="single_row"),
        CheckConstraint("NOT paused OR (reason IS NOT NULL AND since IS NOT NULL)", name="paused_has_reason"),
    )


class BoardPause(Base):
    """A board whose dispatch is paused on its own: one row per paused board, with the operator's
    reason, who and since when; resuming deletes it (``store.pause``). Dispatch claims nothing
    from such a board while every other goes on; the pool-wide pause (``DispatchPause``) stands apart.
    """

    __tablename__ = "board_pauses"

    board: Mapped[str] = mapped_column(String(shapes.BOARD_CHARS), primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    actor: Mapped[str] = mapped_column(String(64))
    since: Mapped[float] = mapped_column(Float)


class ConsoleSignout(Base):
    """A console session signed out before it expired (``store.signouts``), until it would have.

    Kept in the store, not in a ``serve`` process, so every replica refuses the cookie.
    """

    __tablename__ = "console_signouts"

    nonce: Mapped[str] = mapped_column(String(32), primary_key=True)
    expires: Mapped[float] = mapped_column(Float, index=True)


metadata = Base.metadata

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
    board: Mapped[str] = mapped_column(String(64))
    task_id: Mapped[str] = mapped_column(String(128))
    run_id: Mapped[int] = mapped_column(BigInteger)
    ordinal: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    attempt: Mapped[int] = mapped_column(Integer, default=1)
    fence: Mapped[int | None] = mapped_column(BigInteger)
    owner: Mapped[str | None] = mapped_column(String(128))  # the worker instance of the last grant
    lease_until: Mapped[float | None] = mapped_column(Float)
    payload: Mapped[str | None] = mapped_column(Text)
    payload_digest: Mapped[str] = mapped_column(String(64))
    result: Mapped[str | None] = mapped_column(Text)
    result_digest: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float)
    updated_at: Mapped[float] = mapped_column(Float)
    # maintenance bookkeeping: durable backoff and quarantine
    failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    last_error: Mapped[str | None] = mapped_column(Text)
    next_attempt_at: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    quarantined: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())

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

    delivery_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    assignment_id: Mapped[int] = mapped_column(Integer)
    kind: Mapped[str] = mapped_column(String(16))
    digest: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[float] = mapped_column(Float, index=True)

    __table_args__ = (CheckConstraint(f"kind IN ({DELIVERY_KINDS_SQL})", name="kind"),)


class FenceSequence(Base):
    """A single row holding the last fence minted, store-wide and monotonic."""

    __tablename__ = "fence_sequence"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[int] = mapped_column(BigInteger)

    __table_args__ = (CheckConstraint("id = 1", name="single_row"),)


metadata = Base.metadata

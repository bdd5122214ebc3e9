"""The audit trail: every transition of a row appends one event in its own transaction.

Writers call ``append`` with the session or connection of the transition, so
an event exists exactly when its transition committed (docs/design.md,
"Audit trail"). ``history`` reads a row's events oldest first; ``collect``
deletes one batch of events older than the retention cutoff.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, Table, delete, insert, select
from sqlalchemy.orm import Session

from core import db
from store.models import AuditEvent, EventKind

E = AuditEvent
MAX_DETAIL_CHARS = 500
OPERATOR = "operator"


def by_pass(name: str) -> str:
    return f"pass:{name}"


def by_worker(ordinal: int) -> str:
    return f"worker:{ordinal}"


class Event(NamedTuple):
    """One transition, as its writer knows it; ``append`` stamps the time."""

    row_id: int
    kind: EventKind
    actor: str
    from_state: str | None = None
    to_state: str | None = None
    attempt: int | None = None
    fence: int | None = None
    detail: str | None = None


_TABLE = cast(Table, E.__table__)
_COLUMNS = ("row_id", "at", "kind", "from_state", "to_state", "attempt", "fence", "actor", "detail")
# Prepared once and run on the DB-API cursor: every transition runs it, and SQLAlchemy's
# executemany cost the worker's one-event transactions as much as the insert itself.
_INSERT = db.Prepared(insert(_TABLE).inline(), columns=_COLUMNS)


def append(conn: Session | Connection, events: Sequence[Event], *, now: float) -> None:
    """Append the events in the caller's transaction (one executemany)."""
    if not events:
        return
    rows = [
        {
            "row_id": e.row_id,
            "at": now,
            "kind": e.kind.value,
            "from_state": e.from_state,
            "to_state": e.to_state,
            "attempt": e.attempt,
            "fence": e.fence,
            "actor": e.actor[:64],
            "detail": None if e.detail is None else e.detail[:MAX_DETAIL_CHARS],
        }
        for e in events
    ]
    _INSERT.run_many(conn.connection() if isinstance(conn, Session) else conn, rows)


def history(s: Session, row_id: int, *, limit: int | None = None) -> list[dict[str, Any]]:
    """The row's events, oldest first (the newest ``limit`` when given): one index range."""
    stmt = select(E).where(E.row_id == row_id).order_by(E.id.desc())
    if limit is not None:
        stmt = stmt.limit(limit)
    events = list(s.scalars(stmt))
    events.reverse()
    return [
        {
            "id": e.id,
            "at": e.at,
            "kind": e.kind,
            "from": e.from_state,
            "to": e.to_state,
            "attempt": e.attempt,
            "fence": e.fence,
            "actor": e.actor,
            "detail": e.detail,
        }
        for e in events
    ]


def collect(s: Session, *, cutoff: float, batch: int) -> int:
    """Delete one batch of events older than ``cutoff``; returns how many."""
    old = select(E.id).where(E.at < cutoff).order_by(E.id).limit(batch)
    ids = list(s.scalars(old))
    if not ids:
        return 0
    stmt = delete(E).where(E.id.in_(ids)).execution_options(synchronize_session=False)
    return int(s.execute(stmt).rowcount)  # type: ignore[attr-defined]

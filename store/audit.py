"""The audit trail: every transition of a row appends one event in its own transaction.

Writers call these with the session or connection of the transition, so an
event exists exactly when its transition committed (docs/design.md, "Audit
trail"). An event's ``to``, ``attempt`` and ``fence`` are the row's after the
transition, so a row's trail replays to its current state.

- ``append``: events whose values the writer already holds (one executemany);
- ``observed``: events that take ``to``, attempt and fence from the row as the
  transition just left it (one prebuilt INSERT … SELECT per row, no read first);
- ``expired``: the storm's hot path, one multi-row INSERT … SELECT on the
  driver's cursor for a whole expired batch (``expired_from``: the same, inside
  the expiring UPDATE's own statement, on PostgreSQL).

``history`` reads a row's events oldest first; ``search`` finds events by their
detail among the newest; ``collect`` deletes one batch of events older than the
retention cutoff.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, cast

from sqlalchemy import Connection, Table, bindparam, delete, func, insert, select
from sqlalchemy.orm import Session

from core import db, validate
from store.models import Assignment, AuditEvent, EventKind

E = AuditEvent
MAX_DETAIL_CHARS = 500
MAX_ACTOR_CHARS = 64
OPERATOR = "operator"
# The row id of a pool-wide event (``pause``, ``resume``): row ids start at 1, so it is no row's.
POOL = 0
# The default of every writer's ``actor``: code that predates the trail (store.worker, the
# benches, branches in flight) keeps working and says so, rather than being given a guess.
# The plane and the operator paths always name themselves (tests/store/test_audit.py holds them to it).
UNATTRIBUTED = "unattributed"


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
# Written as SQL and run on the driver's cursor with a plain tuple per event: every
# transition runs it, and even a prepared statement's parameter handling cost the
# worker's one-event transactions twice the insert itself (bench/store_bench.py).
_INSERT_SQL = f"INSERT INTO audit_events ({', '.join(_COLUMNS)}) VALUES ({{}})"


def append(conn: Session | Connection, events: Sequence[Event], *, now: float) -> None:
    """Append the events in the caller's transaction (one statement, or one executemany)."""
    if not events:
        return
    c = db.connection_of(conn)
    sql = _INSERT_SQL.format(",".join([db.placeholder(c)] * len(_COLUMNS)))
    rows = [
        (
            e.row_id,
            now,
            e.kind.value,
            e.from_state,
            e.to_state,
            e.attempt,
            e.fence,
            validate.storable(e.actor, MAX_ACTOR_CHARS),
            _bounded(e.detail),
        )
        for e in events
    ]
    with db.driver_cursor(c, sql) as cursor:
        if len(rows) == 1:
            cursor.execute(sql, rows[0])
        else:
            cursor.executemany(sql, rows)


def _bounded(detail: str | None) -> str | None:
    return None if detail is None else validate.storable(detail, MAX_DETAIL_CHARS)


_A = cast(Table, Assignment.__table__).c
# ``from`` defaults to the row's state: an event that is not a state change (children
# retired, a failure noted) chains from → to all the same.
_OBSERVED = insert(_TABLE).from_select(
    ["row_id", "at", "kind", "from_state", "to_state", "attempt", "fence", "actor", "detail"],
    select(
        _A.id,
        bindparam("now", type_=E.at.type),
        bindparam("kind", type_=E.kind.type),
        func.coalesce(bindparam("from_state", type_=_A.state.type), _A.state),
        _A.state,
        _A.attempt,
        _A.fence,
        bindparam("actor", type_=E.actor.type),
        bindparam("detail", type_=E.detail.type),
    ).where(_A.id == bindparam("row_id")),
)


def observed(
    conn: Session | Connection,
    kind: EventKind,
    rows: Sequence[tuple[int, str | None, str | None]],
    *,
    actor: str,
    now: float,
) -> None:
    """One ``kind`` event per ``(row_id, from_state, detail)``, the rest read from the row as it is now.

    ``from_state`` None means the row's state (no state change). One prebuilt
    INSERT … SELECT, executed once per row (an executemany for several).
    """
    if not rows:
        return
    common = {"now": now, "kind": kind.value, "actor": validate.storable(actor, MAX_ACTOR_CHARS)}
    params = [{**common, "row_id": r, "from_state": f, "detail": _bounded(d)} for r, f, d in rows]
    db.connection_of(conn).execute(_OBSERVED, params)


# The storm's hot path (store.transitions.expire_many): one statement for the whole batch,
# on the driver's cursor like the expire UPDATE it follows, with the ids as its only per-row
# parameters. The rows are read back as the UPDATE left them (state, attempt, fence).
_EXPIRED_SQL = (
    "INSERT INTO audit_events (row_id, at, kind, from_state, to_state, attempt, fence, actor)"
    f" SELECT id, {{p}}, '{EventKind.EXPIRY}', 'running', state, attempt, fence, {{p}}"
    " FROM {rows}"
)


def expired(conn: Session | Connection, row_ids: Sequence[int], *, actor: str, now: float) -> None:
    """One ``expiry`` event per row that ``expire_many`` just moved off ``running``: one statement."""
    if not row_ids:
        return
    c = db.connection_of(conn)
    among, ids = db.among(c, row_ids)
    sql = _EXPIRED_SQL.format(p=db.placeholder(c), rows=f"assignments WHERE id {among}")
    db.raw(c, sql, (*expired_params(actor, now), *ids))


def expired_from(rows: str, p: str) -> str:
    """``expired`` as a statement over ``rows`` (a CTE of the moved rows' id, state, attempt and
    fence), for ``expire_many`` to write the events in its UPDATE; its parameters: ``expired_params``."""
    return _EXPIRED_SQL.format(p=p, rows=rows)


def expired_params(actor: str, now: float) -> tuple[float, str]:
    return now, validate.storable(actor, MAX_ACTOR_CHARS)


def history(s: Session, row_id: int, *, limit: int | None = None) -> list[dict[str, Any]]:
    """The row's events, oldest first (the newest ``limit`` when given): one index range."""
    stmt = select(E).where(E.row_id == row_id).order_by(E.id.desc())
    if limit is not None:
        stmt = stmt.limit(limit)
    events = list(s.scalars(stmt))
    events.reverse()
    return [_event(e) for e in events]


def _event(e: AuditEvent) -> dict[str, Any]:
    return {
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


def search(s: Session, text: str, *, window: int, offset: int, limit: int) -> list[dict[str, Any]]:
    """Events among the newest ``window`` whose detail (a reason, the evidence) holds ``text``, newest first.

    Bounded twice: a primary-key range over the newest ``window`` ids (``max(id)`` is the
    index's last entry), and one page of ``limit`` past ``offset`` within it. LIKE, any case.
    """
    newest = select(func.max(E.id)).scalar_subquery()
    stmt = (
        select(E)
        .where(E.id > newest - window, E.detail.icontains(text, autoescape=True))
        .order_by(E.id.desc())
        .offset(offset)
        .limit(limit)
    )
    return [{**_event(e), "row_id": e.row_id} for e in s.scalars(stmt)]


def collect(s: Session, *, cutoff: float, batch: int) -> int:
    """Delete one batch of events older than ``cutoff`` from the head of the id order; how many.

    Events are appended in time order, so the old ones are a prefix of the primary key:
    the batch is read along it and stops at the first event that is not old yet (an
    event stamped by a slower clock only holds the ones behind it until it ages too).
    No index on ``at`` is kept for this: every transition would pay for it.

    The newest event is always kept, so the highest id keeps counting the events
    written (``store.queries.audit_events_written``): without AUTOINCREMENT, SQLite
    would start ids again at 1 in an emptied table. The newest id is compared in SQL,
    where an empty table's ``max`` is NULL and so matches nothing (a fresh store, or
    one upgraded from migration 0003, has no events yet): nothing to collect, and the
    sweep's rows and deliveries are collected all the same.
    """
    newest = select(func.max(E.id)).scalar_subquery()
    head = s.execute(select(E.id, E.at).where(E.id < newest).order_by(E.id).limit(batch)).all()
    old = 0
    while old < len(head) and head[old].at < cutoff:
        old += 1
    if not old:
        return 0
    stmt = delete(E).where(E.id <= head[old - 1].id).execution_options(synchronize_session=False)
    return int(s.execute(stmt).rowcount)  # type: ignore[attr-defined]

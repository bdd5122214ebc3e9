"""Read-only questions the passes and the operator ask: due rows, free ordinals, counts.

Scanner queries are indexed (see ``store.models``), bounded by ``LIMIT`` and
skip rows whose maintenance backoff has not run out yet.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

from sqlalchemy import Connection, Select, func, literal, literal_column, or_, select, tuple_
from sqlalchemy.orm import Session

from core import validate
from store.models import LIVE_STATES, Assignment, AuditEvent, RowState

A = Assignment
_LIVE = [s.value for s in LIVE_STATES]


class Due(NamedTuple):
    """A due row and where it sorts: the scanners page on from the last one (keyset paging)."""

    at: float  # the lease's end (expire) or the backoff's end (the other row passes)
    id: int
    failures: int = 0  # the row's failure streak: a row with one is batched apart (``tasks.declaration``)


def due_expired(s: Session, *, now: float, limit: int, after: Due | None = None) -> list[Due]:
    """``running`` rows whose lease ended (``0 < lease_until < now``), oldest lease first."""
    running = A.state == literal_column(f"'{RowState.RUNNING}'")  # the partial lease index's own words
    if s.get_bind().dialect.name == "sqlite":
        # Without statistics SQLite reads every running row through the state index and sorts
        # them, for every page (21 ms a page at 100k running rows); told the term is likely
        # true, it reads the partial lease index, already in lease order (under 1 ms).
        running = func.likely(running)
    stmt = select(A.lease_until, A.id, A.failures).where(
        running,
        A.lease_until > 0,
        A.lease_until < now,
        A.next_attempt_at <= now,
    )
    return _page(s, stmt, (A.lease_until, A.id), limit, after)


def due_in_state(
    s: Session, state: RowState, *, now: float, limit: int, after: Due | None = None
) -> list[Due]:
    """Rows in ``state`` whose backoff has run out, longest waiting first."""
    stmt = select(A.next_attempt_at, A.id, A.failures).where(A.state == state.value, A.next_attempt_at <= now)
    return _page(s, stmt, (A.next_attempt_at, A.id), limit, after)


def _page(
    s: Session, stmt: Select[Any, Any, Any], order: tuple[Any, Any], limit: int, after: Due | None
) -> list[Due]:
    """One page in ``order``, past ``after``: rows that leave the set meanwhile shift nothing."""
    if after is not None:
        stmt = stmt.where(tuple_(*order) > tuple_(literal(after.at), literal(after.id)))
    return [Due(*row) for row in s.execute(stmt.order_by(*order).limit(limit))]


def traceparents(
    s: Session | Connection, row_ids: Sequence[int], *, limit: int | None = None
) -> dict[int, str]:
    """The stored trace context of those of ``row_ids`` that have one (``core.tracing``), up to ``limit``."""
    found = s.execute(
        select(Assignment.id, Assignment.traceparent)
        .where(Assignment.id.in_(row_ids), Assignment.traceparent.is_not(None))
        .limit(limit)
    )
    return {int(i): str(tp) for i, tp in found}


def free_ordinals(s: Session, pool_size: int) -> list[int]:
    held = set(s.scalars(select(A.ordinal).where(A.state.in_(_LIVE))))
    return [o for o in range(pool_size) if o not in held]


def quarantined_ordinals(s: Session) -> list[int]:
    """Ordinals held by a live row that is quarantined: held until an operator acts."""
    return sorted(s.scalars(select(A.ordinal).where(A.state.in_(_LIVE), A.quarantined)))


def ordinal_counts(free: Sequence[int], quarantined: Sequence[int], pool_size: int) -> dict[str, int]:
    """Ordinals free, held by a healthy live row, and held by a quarantined one (they sum to the pool)."""
    held = pool_size - len(free) - len(quarantined)
    return {"free": len(free), "held": held, "quarantined": len(quarantined)}


def rows_of_board(s: Session, board: str, states: Iterable[RowState]) -> list[Assignment]:
    wanted = [state.value for state in states]
    return list(s.scalars(select(A).where(A.board == board, A.state.in_(wanted)).order_by(A.id)))


def boards_with_live_rows(s: Session) -> list[str]:
    return list(s.scalars(select(A.board).where(A.state.in_(_LIVE)).distinct()))


def known_runs(s: Session, board: str, runs: Iterable[tuple[str, int]]) -> set[tuple[str, int]]:
    """Which of ``(task_id, run_id)`` already have a row, in any state."""
    wanted = list(runs)
    if not wanted:
        return set()
    stmt = select(A.task_id, A.run_id).where(A.board == board, tuple_(A.task_id, A.run_id).in_(wanted))
    return {(t, r) for t, r in s.execute(stmt)}


def run_state(s: Session, board: str, task_id: str, run_id: int) -> RowState | None:
    """The state of the run's row, or None when it has none."""
    stmt = select(A.state).where(A.board == board, A.task_id == task_id, A.run_id == run_id)
    state = s.scalar(stmt)
    return None if state is None else RowState(state)


def row_of_run(s: Session, board: str, task_id: str, run_id: int) -> int | None:
    """The id of the run's row, or None when it has none."""
    return s.scalar(select(A.id).where(A.board == board, A.task_id == task_id, A.run_id == run_id))


def counts_by_state(s: Session) -> dict[str, int]:
    counts = {state.value: 0 for state in RowState}
    for state, n in s.execute(select(A.state, func.count()).group_by(A.state)):
        counts[state] = n
    return counts


def quarantined_count(s: Session) -> int:
    return s.scalar(select(func.count()).select_from(A).where(A.quarantined)) or 0


def oldest_in_state(s: Session, state: RowState) -> float | None:
    """When the longest-waiting row in ``state`` got there (its last change)."""
    return s.scalar(select(func.min(A.updated_at)).where(A.state == state.value))


AnySelect = TypeVar("AnySelect", bound=Select[*tuple[Any, ...]])


class RowFilter(NamedTuple):
    """Which rows a list shows: in ``state``, quarantined only, with ``error`` in the last error."""

    state: RowState | None = None
    quarantined: bool = False
    error: str = ""  # a substring of ``last_error``, any case ("" matches every row)

    def where(self, stmt: AnySelect) -> AnySelect:
        if self.state is not None:
            stmt = stmt.where(A.state == self.state.value)
        if self.quarantined:
            stmt = stmt.where(A.quarantined)
        if self.error:
            stmt = stmt.where(A.last_error.icontains(self.error, autoescape=True))
        return stmt


# What a row list sorts by (the console's ``?sort=``); ``id`` breaks ties, so a page is stable.
ROW_SORTS = {"id": A.id, "state": A.state, "updated": A.updated_at, "attempt": A.attempt}


def rows(
    s: Session,
    *,
    state: RowState | None = None,
    quarantined: bool = False,
    limit: int = 1000,
    where: RowFilter | None = None,
    sort: str = "id",
    descending: bool = False,
    offset: int = 0,
) -> Sequence[Assignment]:
    """One page of the rows matching ``where`` (or ``state`` and ``quarantined``), in ``sort`` order."""
    validate.integer("limit", limit, 1, validate.INT32_MAX)  # an operator's number (`poolctl rows`)
    keys = [ROW_SORTS[sort]] + ([] if sort == "id" else [A.id])
    order = [k.desc() for k in keys] if descending else keys
    stmt = (where or RowFilter(state, quarantined)).where(select(A))
    return list(s.scalars(stmt.order_by(*order).offset(offset).limit(limit)))


def row_ids(s: Session, where: RowFilter, *, limit: int) -> list[int]:
    """The ids of the first ``limit`` rows matching ``where``, lowest first (a bulk action's rows)."""
    return list(s.scalars(where.where(select(A.id)).order_by(A.id).limit(limit)))


def count_upto(s: Session, stmt: Select[*tuple[Any, ...]], upto: int) -> int:
    """How many rows ``stmt`` selects, counted no further than ``upto`` (so ``upto`` means "at least")."""
    return s.scalar(select(func.count()).select_from(stmt.limit(upto).subquery())) or 0


def search_rows(
    s: Session,
    text: str,
    *,
    offset: int,
    limit: int,
    where: RowFilter | None = None,
    tasks: Sequence[tuple[str, str]] = (),
) -> tuple[list[Assignment], int]:
    """Rows (of those ``where`` takes) whose id or run id is ``text``, or whose task id, owner, board or
    last error holds it, or that run one of ``tasks`` (board, task id).

    A page of them, newest first, and how many there are (counted up to ``SEARCH_COUNT_UPTO``).
    LIKE on text reads the rows table, which GC keeps to the live rows and the retention period's.
    ``tasks`` are what the board's index found for the text: a row's payload is its task's title and
    body (``validate.run_payload``), so this is how rows are found by their payload (one probe of
    ``uq_assignments_identity`` per task).
    """
    stmt = (where or RowFilter()).where(select(A).where(_mentions(text, tasks)))
    found = list(s.scalars(stmt.order_by(A.id.desc()).offset(offset).limit(limit)))
    return found, count_upto(s, stmt, SEARCH_COUNT_UPTO)


SEARCH_COUNT_UPTO = 10_000


def _mentions(text: str, tasks: Sequence[tuple[str, str]]) -> Any:
    columns = (A.task_id, A.owner, A.board, A.last_error)
    terms = [column.icontains(text, autoescape=True) for column in columns]
    terms += [tuple_(A.board, A.task_id).in_(list(tasks))] if tasks else []
    if text.isascii() and text.isdigit() and len(text) <= 18:
        terms += [A.run_id == int(text)]
        terms += [A.id == int(text)] if int(text) <= validate.MAX_ROW_ID else []
    return or_(*terms)


def audit_events_written(s: Session) -> int:
    """The audit table's highest event id: the events written since ``init``.

    GC deletes the oldest first and always keeps the newest, so ids never start again.
    On PostgreSQL an id taken by a transaction that rolled back counts too.
    """
    return s.scalar(select(func.max(AuditEvent.id))) or 0


def rows_of_tasks(s: Session, board: str, task_ids: Sequence[str]) -> list[Assignment]:
    """Every row (any state) of these board tasks, oldest run first: the console's board page."""
    if not task_ids:
        return []
    stmt = select(A).where(A.board == board, A.task_id.in_(list(task_ids))).order_by(A.task_id, A.run_id)
    return list(s.scalars(stmt))


class Waiting(NamedTuple):
    """An ``assigned`` row and since when it waits for its ordinal's worker."""

    id: int
    ordinal: int
    since: float


def assigned_since(s: Session) -> list[Waiting]:
    """Every ``assigned`` row (at most the pool size), by ordinal; ``updated_at`` is when it got there."""
    stmt = select(A.id, A.ordinal, A.updated_at).where(A.state == RowState.ASSIGNED.value).order_by(A.ordinal)
    return [Waiting(*r) for r in s.execute(stmt)]


class Held(NamedTuple):
    """What holds an ordinal: its live row's id, run and state."""

    ordinal: int
    id: int
    board: str
    task_id: str
    run_id: int
    state: str


def held(s: Session) -> list[Held]:
    """The live rows' identities, by ordinal (at most one per ordinal, so at most the pool size)."""
    stmt = select(A.ordinal, A.id, A.board, A.task_id, A.run_id, A.state).where(A.state.in_(_LIVE))
    return [Held(*r) for r in s.execute(stmt.order_by(A.ordinal))]


def live_rows(s: Session) -> list[Assignment]:
    """The rows holding an ordinal (at most one per ordinal, so at most the pool size)."""
    return list(s.scalars(select(A).where(A.state.in_(_LIVE)).order_by(A.ordinal)))

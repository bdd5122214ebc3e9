"""Trends: the audit trail counted per time bucket, each chart one primary-key range.

What the console's Trends page charts (docs/design.md, "Console", Trends), for a window
of ``Window.buckets`` buckets of ``Window.seconds`` ending with the bucket of ``now``:

- events per bucket by kind (``SERIES`` maps the audit kinds onto the charted ones);
- rows per non-terminal state at the end of each bucket: today's counts walked back
  through each bucket's state changes (an event whose ``from`` differs from its ``to``);
  terminal states are not charted, since gc deletes terminal rows without an event;
- expiry → re-grant latency: per bucket, the mean and the longest wait between a row's
  ``expiry`` to ``assigned`` and its next ``grant`` (the expiry event does not carry the
  lease's end; the pass's lateness after it is ``poolkeeper_expiry_to_reoffer_seconds``).

Cost: no index on ``at`` (every transition would pay for it, ``store.audit.collect``).
Events are appended in time order, so the window is a range of the primary key:
``first_id`` bisects the ids for the first event at or after a cutoff (a few dozen
primary-key seeks), and each chart reads ``WHERE id >= :first`` and filters on ``at``.
The cutoff is taken ``SLACK_SECONDS`` early, so an event stamped by a caller that waited
for the write lock, and so appended behind a later stamp, is still counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, cast

from sqlalchemy import Select, Table, func, select
from sqlalchemy.orm import Session

from store.models import AuditEvent, EventKind, RowState

E = cast(Table, AuditEvent.__table__).c
SLACK_SECONDS = 60.0
CHARTED_STATES = (RowState.ASSIGNED, RowState.RUNNING, RowState.RESULT, RowState.LEASE_FAILED)
SERIES: dict[str, tuple[EventKind, ...]] = {
    "grants": (EventKind.GRANT,),
    "results": (EventKind.RESULT,),
    "expiries": (EventKind.EXPIRY,),
    "settles": (EventKind.SETTLE, EventKind.ABANDON, EventKind.CANCEL),
    "failures": (EventKind.FAILURE, EventKind.QUARANTINE),
}


@dataclass(frozen=True)
class Window:
    name: str
    seconds: int  # one bucket
    buckets: int


HOUR = Window("hour", 60, 60)
DAY = Window("day", 600, 144)


@dataclass(frozen=True)
class Trend:
    window: Window
    starts: list[float]  # each bucket's start, oldest first; the last holds ``now``
    events: dict[str, list[int]]  # SERIES name -> events per bucket
    rows: dict[str, list[int]]  # CHARTED_STATES value -> rows at each bucket's end (the last: now)
    latency_mean: list[float | None]  # expiry -> re-grant, seconds; None: no re-grant in the bucket
    latency_max: list[float | None]


def first_id(s: Session, since: float) -> int | None:
    """The lowest event id whose ``at`` is at or after ``since`` (None: none is): a bisection of the ids.

    Ids have gaps (gc, rolled-back inserts), so each step reads the first event at or
    after an id: one primary-key seek, about 2·log2(ids) in all.
    """
    # two statements: SQLite reads min() or max() off the primary key only when it is alone
    lo, hi = s.scalar(select(func.min(E.id))), s.scalar(select(func.max(E.id)))
    if lo is None or hi is None or _next(s, hi)[1] < since:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if _next(s, mid)[1] >= since:
            hi = mid
        else:
            lo = mid + 1
    return _next(s, lo)[0]


def _next(s: Session, event_id: int) -> tuple[int, float]:
    """The id and time of the first event at or after ``event_id``."""
    found = s.execute(_seek(event_id)).one()
    return int(found.id), float(found.at)


def _seek(event_id: int) -> Select[Any]:
    return select(E.id, E.at).where(E.id >= event_id).order_by(E.id).limit(1)


def read(s: Session, window: Window, now: float, current: dict[str, int]) -> Trend:
    """The window's charts ending with the bucket of ``now``; ``current`` is the rows by state now."""
    width, n = window.seconds, window.buckets
    last = math.floor(now / width)
    since = (last - n + 1) * width
    starts = [float((last - n + 1 + i) * width) for i in range(n)]
    events = {name: [0] * n for name in SERIES}
    deltas = {state.value: [0] * n for state in CHARTED_STATES}
    mean: list[float | None] = [None] * n
    longest: list[float | None] = [None] * n
    first = first_id(s, since - SLACK_SECONDS)
    if first is not None:
        series_of = {kind.value: name for name, kinds in SERIES.items() for kind in kinds}
        for bucket, kind, came, went, count in s.execute(_counts(first, since, width)):
            i = min(int(bucket) - (last - n + 1), n - 1)  # an event stamped after now: the last bucket
            if kind in series_of:
                events[series_of[kind]][i] += count
            if came != went:
                if went in deltas:
                    deltas[went][i] += count
                if came in deltas:
                    deltas[came][i] -= count
        for bucket, avg, top in s.execute(_latency(first, since, width)):
            i = min(int(bucket) - (last - n + 1), n - 1)
            mean[i], longest[i] = float(avg), float(top)
    rows = {}
    for state, delta in deltas.items():
        counts, at_end = [0] * n, current.get(state, 0)
        for i in range(n - 1, -1, -1):
            counts[i] = at_end
            at_end -= delta[i]
        rows[state] = counts
    return Trend(window, starts, events, rows, mean, longest)


def _counts(first: int, since: float, width: int) -> Select[Any]:
    """One grouped read over the range: events by bucket, kind and state change."""
    bucket = func.floor(E.at / width).label("bucket")
    return (
        select(bucket, E.kind, E.from_state, E.to_state, func.count())
        .where(E.id >= first, E.at >= since)
        .group_by(bucket, E.kind, E.from_state, E.to_state)
    )


def _latency(first: int, since: float, width: int) -> Select[Any]:
    """Per bucket of the grant: mean and longest wait since the row's expiry just before it.

    Partitioned by ``row_id + 0``: by the bare column, SQLite walks all of
    ``ix_audit_events_row_id`` to skip the sort, reading the whole table instead of the range.
    """
    by_row = E.row_id + 0
    steps = (
        select(
            E.at,
            E.kind,
            func.lag(E.kind).over(partition_by=by_row, order_by=E.id).label("before"),
            func.lag(E.at).over(partition_by=by_row, order_by=E.id).label("expired_at"),
            func.lag(E.to_state).over(partition_by=by_row, order_by=E.id).label("expired_to"),
        )
        .where(E.id >= first, E.kind.in_([EventKind.EXPIRY.value, EventKind.GRANT.value]))
        .subquery()
    )
    wait = steps.c.at - steps.c.expired_at
    bucket = func.floor(steps.c.at / width).label("bucket")
    return (
        select(bucket, func.avg(wait), func.max(wait))
        .where(
            steps.c.kind == EventKind.GRANT.value,
            steps.c.before == EventKind.EXPIRY.value,
            steps.c.expired_to == RowState.ASSIGNED.value,
            steps.c.at >= since,
        )
        .group_by(bucket)
    )

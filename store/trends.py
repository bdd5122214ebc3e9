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
- the wait (ready → claimed) and run time (grant → result) percentiles, p50/p95/p99 per
  bucket: the wait of each ``claim`` event from its row's ``ready_at`` (when the board said
  the task turned ready; rows without one are left out), bucketed at the claim; the run time
  of each ``result`` event from the ``grant`` before it on its row (one index seek each, so a
  run longer than the window still counts), bucketed at the result. The percentiles come
  from counts over ``DURATION_BUCKETS``, the buckets of ``poolkeeper_task_wait_seconds`` and
  ``poolkeeper_run_seconds``, interpolated within a bucket as Prometheus'
  ``histogram_quantile`` does: the console and a dashboard read the same numbers.

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

from sqlalchemy import ColumnElement, FromClause, Select, Table, case, func, select
from sqlalchemy.orm import Session

from store.models import Assignment, AuditEvent, EventKind, RowState

_EVENTS = cast(Table, AuditEvent.__table__)
E = _EVENTS.c
_GRANTS = _EVENTS.alias("grants")
A = cast(Table, Assignment.__table__).c
SLACK_SECONDS = 60.0
CHARTED_STATES = (RowState.ASSIGNED, RowState.RUNNING, RowState.RESULT, RowState.LEASE_FAILED)
SERIES: dict[str, tuple[EventKind, ...]] = {
    "grants": (EventKind.GRANT,),
    "results": (EventKind.RESULT,),
    "expiries": (EventKind.EXPIRY,),
    "settles": (EventKind.SETTLE, EventKind.ABANDON, EventKind.CANCEL),
    "failures": (EventKind.FAILURE, EventKind.QUARANTINE),
}
# Upper bounds (seconds) of the wait and run time buckets, 1 ms to a day: the histograms' and the
# percentile charts' alike. A value above the last is counted past it and read as the last.
DURATION_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0, 86400.0,
)  # fmt: skip
QUANTILES = {"p50": 0.5, "p95": 0.95, "p99": 0.99}


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
    waits: dict[str, list[float | None]]  # QUANTILES name -> ready -> claimed, seconds; None: no claim
    runs: dict[str, list[float | None]]  # QUANTILES name -> grant -> result, seconds; None: no result


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
    percentiles = []
    for durations in (_waits, _runs):
        slots = [[0] * (len(DURATION_BUCKETS) + 1) for _ in range(n)]
        if first is not None:
            for bucket, slot, count in s.execute(durations(first, since, width)):
                slots[min(int(bucket) - (last - n + 1), n - 1)][int(slot)] += count
        percentiles.append({name: [quantile(q, c) for c in slots] for name, q in QUANTILES.items()})
    rows = {}
    for state, delta in deltas.items():
        counts, at_end = [0] * n, current.get(state, 0)
        for i in range(n - 1, -1, -1):
            counts[i] = at_end
            at_end -= delta[i]
        rows[state] = counts
    return Trend(window, starts, events, rows, mean, longest, *percentiles)


def quantile(q: float, counts: list[int]) -> float | None:
    """The ``q`` quantile of values counted per ``DURATION_BUCKETS`` slot (the last: past them all),
    linear within its bucket as ``histogram_quantile`` reads it; None when nothing was counted."""
    rank, below = q * sum(counts), 0
    for slot, n in enumerate(counts):
        if n and below + n >= rank:
            if slot == len(DURATION_BUCKETS):
                return DURATION_BUCKETS[-1]
            low = DURATION_BUCKETS[slot - 1] if slot else 0.0
            return low + (DURATION_BUCKETS[slot] - low) * (rank - below) / n
        below += n
    return None


def run_seconds(s: Session, row_id: int) -> float | None:
    """The row's last run time: its last ``result`` since the ``grant`` before it (None: no such pair)."""
    found = s.scalar(
        select(E.at - _granted())
        .where(E.row_id == row_id, E.kind == EventKind.RESULT.value)
        .order_by(E.id.desc())
        .limit(1)
    )
    return None if found is None else float(found)


def _granted() -> ColumnElement[float]:
    """The time of the last ``grant`` before this event on its row: one seek of ``ix_audit_events_row_id``."""
    g = _GRANTS.c
    return (
        select(g.at)
        .where(g.row_id == E.row_id, g.id < E.id, g.kind == EventKind.GRANT.value)
        .order_by(g.id.desc())
        .limit(1)
        .correlate(_EVENTS)
        .scalar_subquery()
    )


def _waits(first: int, since: float, width: int) -> Select[Any]:
    """Claims per bucket and wait slot: each ``claim`` event since its row's ``ready_at``.

    Joined on ``row_id + 0``: by the bare column SQLite would walk all of ``assignments`` and
    seek each row's events; so the range drives, with a primary-key seek per claim (a correlated
    seek instead costs PostgreSQL twice the join's time, bench/trends.py).
    """
    rows = _EVENTS.join(Assignment.__table__, A.id == E.row_id + 0)
    return _spans(EventKind.CLAIM, A.ready_at, first, since, width, rows)


def _runs(first: int, since: float, width: int) -> Select[Any]:
    """Results per bucket and run time slot: each ``result`` event since the ``grant`` before it."""
    return _spans(EventKind.RESULT, _granted(), first, since, width, _EVENTS)


def _spans(
    kind: EventKind, start: ColumnElement[float], first: int, since: float, width: int, source: FromClause
) -> Select[Any]:
    """``kind`` events of the range per bucket and ``DURATION_BUCKETS`` slot of their time since ``start``.

    ``MATERIALIZED`` (SQLite 3.35+, PostgreSQL 12+): folded into the outer query, a ``start`` that
    seeks (the grant) would seek again in each of the slot's ``WHEN``s.
    """
    spans = (
        select(func.floor(E.at / width).label("bucket"), (E.at - start).label("seconds"))
        .select_from(source)
        .where(E.id >= first, E.at >= since, E.kind == kind.value)
        .cte("spans")
        .prefix_with("MATERIALIZED")
    )
    seconds = spans.c.seconds
    slot = case(*((seconds <= b, i) for i, b in enumerate(DURATION_BUCKETS)), else_=len(DURATION_BUCKETS))
    return (
        select(spans.c.bucket, slot.label("slot"), func.count())
        .where(seconds.is_not(None))
        .group_by(spans.c.bucket, slot)
    )


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

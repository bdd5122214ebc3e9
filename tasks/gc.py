"""Collect garbage.

Qualifies: ``finalized`` and ``stale`` rows (and only those) whose last change
is older than the retention, delivery records older than it (a row not yet settled
keeps its result and release records, so their replay is still a duplicate), and
audit events older than it (an event goes by its age, whatever its row's state).
Does: deletes them in batches of ``gc_batch``, one short transaction each (so no
transaction holds the write lock for long), until none is left or the sweep has
run for half the task's time limit (``allowed_seconds``). The deletion rate is the
database's, not a fixed count per sweep: a pool that writes more delivery
records in an interval than a fixed count would delete grows without end. A
sweep that ends on its budget with garbage left says so (a warning, and
``behind`` in its log line); the rest waits for the next sweep, and an operator
who sees the warning every sweep shortens ``GC_SECONDS``. ``lease_failed`` rows
are never collected.
Returns: ``collected`` (counts in a ``Collected``, the log line and the
``poolkeeper_gc_deleted`` counter, ``kind`` rows, deliveries or events) or
``nothing``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from store import audit, transitions
from tasks.declaration import Key, Lock, Outcome, Pass, Submit
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")
ALL: Sequence[Key] = ("all",)  # one key: GC is one sweep, under its own lock


@dataclass(frozen=True)
class Collected:
    rows: int = 0
    deliveries: int = 0
    events: int = 0
    behind: bool = False  # the sweep ended on its budget with garbage left


def allowed_seconds(plane: Plane) -> float:
    """Seconds a sweep may run: half the task's hard limit, well inside the soft one (80 %)."""
    return plane.settings.task_time_limit / 2


def collect(plane: Plane, now: float, *, clock: Callable[[], float] = time.monotonic) -> Collected:
    rows = deliveries = events = 0
    batch, retention = plane.settings.gc_batch, plane.settings.retention_seconds
    ends = clock() + allowed_seconds(plane)
    while True:
        with plane.store.session() as s:
            r, d = transitions.collect_garbage(s, retention_seconds=retention, batch=batch, now=now)
            e = audit.collect(s, cutoff=now - retention, batch=batch)
        rows, deliveries, events = rows + r, deliveries + d, events + e
        if r < batch and d < batch and e < batch:
            return Collected(rows, deliveries, events)
        if clock() >= ends:
            return Collected(rows, deliveries, events, behind=True)


def run(plane: Plane, _key: Key, now: float) -> Outcome:
    from tasks import metrics  # prometheus_client: not for `poolctl status`, which reads PASSES

    got = collect(plane, now)
    if not (got.rows or got.deliveries or got.events):
        return Outcome.NOTHING
    counts = {"rows": got.rows, "deliveries": got.deliveries, "events": got.events}
    for kind, n in counts.items():  # the metric's kind label
        metrics.GC_DELETED.labels(kind).inc(n)
    log.log(
        logging.WARNING if got.behind else logging.INFO,
        "gc: deleted %d rows, %d deliveries, %d audit events%s",
        got.rows,
        got.deliveries,
        got.events,
        f"; behind: garbage is left after this sweep's {allowed_seconds(plane):g}s (shorten GC_SECONDS)"
        if got.behind
        else "",
        extra={"gc": {**counts, "behind": got.behind}},
    )
    return Outcome.COLLECTED


def find(_plane: Plane, _now: float, submit: Submit) -> int:
    return len(submit(PASS.name, ALL))


PASS = Pass(name="gc", lock=Lock.OWN, interval=lambda s: s.gc_seconds, find=find, run=run)

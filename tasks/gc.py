"""Collect garbage.

Qualifies: ``finalized`` and ``stale`` rows (and only those) whose last change
is older than the retention, and delivery records and audit events older than
it (an event goes by its age, whatever its row's state).
Does: deletes them in bounded batches, one short transaction each, and stops
after ``MAX_BATCHES`` so no tick holds the write lock for long; the rest waits
for the next tick. ``lease_failed`` rows are never collected.
Returns: ``collected`` (counts in a ``Collected``, the log line and the
``poolkeeper_gc_deleted`` counter, ``kind`` rows, deliveries or events) or
``nothing``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from store import audit, transitions
from tasks import metrics
from tasks.declaration import Key, Lock, Outcome, Pass, Submit
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")
MAX_BATCHES = 20
ALL: Sequence[Key] = ("all",)  # one key: GC is one sweep, under its own lock


@dataclass(frozen=True)
class Collected:
    rows: int = 0
    deliveries: int = 0
    events: int = 0


def collect(plane: Plane, now: float) -> Collected:
    rows = deliveries = events = 0
    batch, retention = plane.settings.gc_batch, plane.settings.retention_seconds
    for _ in range(MAX_BATCHES):
        with plane.store.session() as s:
            r, d = transitions.collect_garbage(s, retention_seconds=retention, batch=batch, now=now)
            e = audit.collect(s, cutoff=now - retention, batch=batch)
        rows, deliveries, events = rows + r, deliveries + d, events + e
        if r < batch and d < batch and e < batch:
            break
    return Collected(rows, deliveries, events)


def run(plane: Plane, _key: Key, now: float) -> Outcome:
    got = collect(plane, now)
    if not (got.rows or got.deliveries or got.events):
        return Outcome.NOTHING
    for kind, n in got.__dict__.items():  # the label is a field name: rows, deliveries, events
        metrics.GC_DELETED.labels(kind).inc(n)
    log.info(
        "gc: deleted %d rows, %d deliveries, %d audit events",
        got.rows,
        got.deliveries,
        got.events,
        extra={"gc": got.__dict__},
    )
    return Outcome.COLLECTED


def find(_plane: Plane, _now: float, submit: Submit) -> int:
    return len(submit(PASS.name, ALL))


PASS = Pass(name="gc", lock=Lock.OWN, interval=lambda s: s.gc_seconds, find=find, run=run)

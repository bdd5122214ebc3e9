"""Collect garbage.

Qualifies: ``finalized`` and ``stale`` rows (and only those) whose last change
is older than the retention, and delivery records older than it.
Does: deletes them in bounded batches, one short transaction each, and stops
after ``MAX_BATCHES`` so no tick holds the write lock for long; the rest waits
for the next tick. ``lease_failed`` rows are never collected.
Returns: ``collected`` (counts in a ``Collected``, the log line and the
``poolkeeper_gc_deleted`` counter) or ``nothing``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from store import transitions
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


def collect(plane: Plane, now: float) -> Collected:
    rows = deliveries = 0
    batch = plane.settings.gc_batch
    for _ in range(MAX_BATCHES):
        with plane.store.session() as s:
            r, d = transitions.collect_garbage(
                s, retention_seconds=plane.settings.retention_seconds, batch=batch, now=now
            )
        rows, deliveries = rows + r, deliveries + d
        if r < batch and d < batch:
            break
    return Collected(rows, deliveries)


def run(plane: Plane, _key: Key, now: float) -> Outcome:
    got = collect(plane, now)
    if not (got.rows or got.deliveries):
        return Outcome.NOTHING
    metrics.GC_DELETED.labels("rows").inc(got.rows)
    metrics.GC_DELETED.labels("deliveries").inc(got.deliveries)
    log.info("gc: deleted %d rows, %d deliveries", got.rows, got.deliveries, extra={"gc": got.__dict__})
    return Outcome.COLLECTED


def find(_plane: Plane, _now: float, submit: Submit) -> int:
    return len(submit(PASS.name, ALL))


PASS = Pass(name="gc", lock=Lock.OWN, interval=lambda s: s.gc_seconds, find=find, run=run)

"""Collect garbage.

Qualifies: ``finalized`` and ``stale`` rows (and only those) whose last change
is older than the retention, and delivery records older than it.
Does: deletes them in bounded batches, one short transaction each, and stops
after ``MAX_BATCHES`` so no tick holds the write lock for long; the rest waits
for the next tick. ``lease_failed`` rows are never collected.
Returns: ``"collected rows=N deliveries=M"``, or ``"nothing"``.
"""

from __future__ import annotations

from store import transitions
from tasks.plane import Plane

MAX_BATCHES = 20


def run(plane: Plane, _key: object, now: float) -> str:
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
    return f"collected rows={rows} deliveries={deliveries}" if rows or deliveries else "nothing"

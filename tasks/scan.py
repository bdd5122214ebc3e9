"""Scanners: run a pass's ``find`` and enqueue what it submits, at most once per (pass, key).

A key is enqueued only if its pending marker could be set, so the queue holds
at most one message per (pass, key) however often the scanners (or two beats)
run and however slow the workers are. Keys travel in batches
(``store_batch_size`` for store-only passes, ``batch_size`` for the others);
each one still gets its own lock and its own outcome. A finished scan stamps
the pass's last scan time (``Coordination.record_scan``) for ``tasks.liveness``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tasks import registry
from tasks.declaration import Key, Submit
from tasks.plane import Plane

Enqueue = Callable[[str, list[Key]], None]


def scan(plane: Plane, pass_name: str, now: float, enqueue: Enqueue) -> int:
    """Run one pass's scanner; returns how many keys it enqueued (for any pass).

    A scan that finished, whatever it found, stamps the pass's last scan
    (``tasks.liveness``: beat liveness); one that raised does not.
    """
    n = registry.get(pass_name).find(plane, now, submitter(plane, enqueue))
    plane.coord.record_scan(pass_name, now)
    return n


def submitter(plane: Plane, enqueue: Enqueue) -> Submit:
    def submit(pass_name: str, keys: Sequence[Key]) -> list[Key]:
        p = registry.get(pass_name)
        by_name = {p.key_name(k): k for k in keys}
        fresh = [by_name[n] for n in plane.coord.mark_pending(pass_name, by_name)]
        size = plane.settings.store_batch_size if p.store_only else plane.settings.batch_size
        for start in range(0, len(fresh), size):
            try:
                enqueue(pass_name, fresh[start : start + size])
            except Exception:
                plane.coord.clear_pending(pass_name, (p.key_name(k) for k in fresh[start:]))
                raise
        return fresh

    return submit

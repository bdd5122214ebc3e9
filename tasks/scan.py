"""Scanners: run a pass's ``find`` and enqueue what it submits, at most once per (pass, key).

A key is enqueued only if its pending marker could be set, so the queue holds
at most one message per (pass, key) however often the scanners (or two beats)
run and however slow the workers are. The scanner holds the markers until the
message is sent, so one that dies in between leaves nothing pending for long. Keys travel in batches
(``store_batch_size`` for store-only passes, ``batch_size`` for the others);
each one still gets its own lock and its own outcome. A finished scan stamps
the pass's last scan time (``Coordination.record_scan``) for ``tasks.liveness``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import suppress

from core.errors import TransientError
from tasks import registry
from tasks.declaration import Key, Submit
from tasks.plane import Plane

Enqueue = Callable[[str, list[Key]], None]


def scan(plane: Plane, pass_name: str, now: float, enqueue: Enqueue, *, record: bool = True) -> int:
    """Run one pass's scanner; returns how many keys it enqueued (for any pass).

    A scan that finished, whatever it found, stamps the pass's last scan
    (``tasks.liveness``: beat liveness); one that raised does not, nor one an event
    asked for (``record`` False): only beat's own scans say that beat runs.
    """
    n = registry.get(pass_name).find(plane, now, submitter(plane, enqueue))
    if record:
        plane.coord.record_scan(pass_name, now)
    return n


def submitter(plane: Plane, enqueue: Enqueue) -> Submit:
    def submit(pass_name: str, keys: Sequence[Key]) -> list[Key]:
        p = registry.get(pass_name)
        by_name = {p.key_name(k): k for k in keys}
        fresh = [by_name[n] for n in plane.coord.mark_pending(pass_name, by_name)]
        size = plane.settings.store_batch_size if p.store_only else plane.settings.batch_size
        sent = 0
        try:
            for start in range(0, len(fresh), size):
                batch = fresh[start : start + size]
                enqueue(pass_name, batch)
                sent = start + len(batch)
                plane.coord.queue_pending(pass_name, [p.key_name(k) for k in batch])  # the queue has it
        except BaseException:  # the unsent ones' markers go (a sent batch's lapse: sent again, harmless)
            with suppress(TransientError):  # the keeper lets go of them first: they lapse within a hold
                plane.coord.clear_pending(pass_name, (p.key_name(k) for k in fresh[sent:]))
            raise
        return fresh

    return submit

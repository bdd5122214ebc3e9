"""Scanners: cheap indexed queries that find due keys and enqueue per-key work.

A key is enqueued only if its pending marker could be set, so the queue holds
at most one message per (pass, key) however often the scanners (or two beats)
run and however slow the workers are. Keys travel in batches of
``batch_size``; each one still gets its own lock and transactions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from tasks import expire, lease_failures, materialize, results
from tasks.plane import Plane
from tasks.runner import key_name

Enqueue = Callable[[str, list[Any]], None]
DUE: dict[str, Callable[[Plane, float, int, int], list[int]]] = {
    "expire": expire.due,
    "lease_failures": lease_failures.due,
    "results": results.due,
}


MAX_PAGES = 10


def scan(plane: Plane, pass_name: str, now: float, enqueue: Enqueue) -> int:
    """Enqueue up to ``scan_limit`` due rows of one row pass; returns how many were enqueued.

    Rows already pending are skipped by paging on, so a backlog at the head of
    the index never hides the due rows behind it (bounded: ``MAX_PAGES`` pages).
    """
    limit = plane.settings.scan_limit
    enqueued = 0
    for page in range(MAX_PAGES):
        due = DUE[pass_name](plane, now, limit, page * limit)
        enqueued += submit(plane, pass_name, due, enqueue)
        if len(due) < limit or enqueued >= limit:
            break
    return enqueued


def scan_boards(plane: Plane, enqueue: Enqueue) -> int:
    return submit(plane, "reconcile", plane.board.list_boards(), enqueue)


def dispatch(plane: Plane, enqueue: Enqueue) -> int:
    """One dispatch at a time, plane-wide: a slow or locked board then holds one worker, not all."""
    [token] = plane.coord.lock_many(["dispatch"])
    if token is None:
        return 0
    try:
        return submit(plane, "materialize", materialize.dispatch(plane), enqueue)
    finally:
        plane.coord.unlock_many({"dispatch": token})


def submit(plane: Plane, pass_name: str, keys: Sequence[Any], enqueue: Enqueue) -> int:
    by_name = {key_name(pass_name, k): k for k in keys}
    fresh = [by_name[n] for n in plane.coord.mark_pending(pass_name, by_name)]
    size = plane.settings.batch_size
    for start in range(0, len(fresh), size):
        batch = fresh[start : start + size]
        try:
            enqueue(pass_name, batch)
        except Exception:
            plane.coord.clear_pending(pass_name, (key_name(pass_name, k) for k in fresh[start:]))
            raise
    return len(fresh)

"""What a maintenance pass declares about itself, and the outcomes it may report.

Each pass module ends with one ``PASS = Pass(...)``; ``tasks.registry`` lists
them, and the beat schedule, ``poolctl maintain --once``, the scanners, the
runner and the Celery tasks all iterate that list (docs/design.md, "Passes").

A pass is two halves:

- ``find`` (the scanner, run by beat at ``interval``): a cheap indexed query
  that hands due keys to ``submit``; a scanner may also feed another pass
  (reconcile hands orphaned runs to materialize);
- the per-key work, exactly one of: ``run_in`` (store-only: a batch of keys
  in one transaction and one set-based statement, split where it fails) or
  ``run`` (talks to the board: each key in its own short transactions, none
  held across a board call).

``lock`` says which Redis lock a key takes: the row's own (``ROW``: every
pass on one row excludes the others) or the pass's (``OWN``: claims, GC).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from sqlalchemy import Connection

from core.settings import Settings
from store.queries import Due

if TYPE_CHECKING:
    from tasks.plane import Plane

Key = Any  # a row id, a claim dict or "all": whatever the pass's scanner submits, JSON in a message
# submit(pass name, keys) -> the keys that were enqueued (not already pending)
Submit = Callable[[str, Sequence[Key]], list[Key]]
Finder = Callable[["Plane", float, Submit], int]
KeyWork = Callable[["Plane", Key, float], "Outcome"]
# (connection, plane, the batch's keys, now) -> each key's outcome, or the error that refused
# it (that key's failure, the others commit); a key left out lost its race
ConnectionWork = Callable[[Connection, "Plane", list[Key], float], dict[Key, "Outcome | Exception"]]


class Lock(StrEnum):
    ROW = "row"  # the row's lock, shared by every pass that works on rows
    OWN = "own"  # a lock of the pass's own, per key


class Outcome(StrEnum):
    """Everything a key of a pass can come to. Only these become metric labels."""

    REOFFERED = "reoffered"
    LEASE_FAILED = "lease_failed"
    FINALIZED = "finalized"
    STALE = "stale"
    CURRENT = "current"  # the board still runs this row's run: nothing to do
    ADDED = "added"
    DUPLICATE = "duplicate"
    PARKED = "parked"
    WAITS = "waits"  # a claim with no ordinal free: dispatch serves it first (``materialize``)
    VANISHED = "vanished"
    MOVED_ON = "moved_on"
    COLLECTED = "collected"
    NOTHING = "nothing"
    LOST_RACE = "lost_race"
    LOCK_BUSY = "lock_busy"
    DEFERRED = "deferred"
    FAILED = "failed"
    QUARANTINED = "quarantined"
    RETRY_LATER = "retry_later"
    SCAN_BUSY = "scan_busy"
    SCAN_FAILED = "scan_failed"


# No line per key for these: nothing happened, or someone else did it.
QUIET = frozenset({Outcome.LOST_RACE, Outcome.NOTHING, Outcome.LOCK_BUSY, Outcome.CURRENT})


def row_ids(key: Key) -> dict[str, Any]:
    """A row pass's key is its row id; other keys (GC's "all") name no row."""
    return {"row_id": key} if isinstance(key, int) and not isinstance(key, bool) else {}


@dataclass(frozen=True)
class Pass:
    name: str
    lock: Lock
    interval: Callable[[Settings], float]  # how often beat runs ``find``
    find: Finder
    run: KeyWork | None = None
    run_in: ConnectionWork | None = None
    key_name: Callable[[Key], str] = str  # the key in lock and marker names and in logs
    # The ordinal a key holds reserved (materialize's claims): the worker that receives the
    # key holds the reservation, and a key that does not run (lock busy) gives it back.
    reserves: Callable[[Key], int] | None = None
    # The ids a key stands for on the log lines about it (``core.logs.bound``): a row id's row.
    log_ids: Callable[[Key], dict[str, Any]] = row_ids

    def __post_init__(self) -> None:
        if (self.run is None) == (self.run_in is None):
            raise TypeError(f"pass {self.name}: give exactly one of run (board) or run_in (store-only)")

    @property
    def store_only(self) -> bool:
        return self.run_in is not None

    def lock_name(self, key: Key) -> str:
        return f"row:{self.key_name(key)}" if self.lock is Lock.ROW else f"{self.name}:{self.key_name(key)}"


# A scanner pages on while it finds full pages, up to this many pages a tick: a storm
# drains as fast as the workers go, while one tick's work stays bounded.
MAX_PAGES = 100
# Rows with a failure streak are submitted apart, this many a message, after every clean
# batch of the tick: a clean batch then never pays the search for a row that failed
# before, nor waits in the queue behind a batch of suspects; a batch of suspects is tried
# row by row once it fails (``core.isolate``).
SUSPECTS_PER_BATCH = 16

DueQuery = Callable[..., list[Due]]  # (session, *, now, limit, after) -> one page of due rows


def due_rows(pass_name: str, due: DueQuery) -> Finder:
    """A scanner over one indexed due-rows query, paging on while pages come back full.

    Pages are keyset pages (each starts past the last row of the one before), so
    rows that workers finish meanwhile shift nothing and no due row is skipped
    until the next tick. Rows already pending are skipped (their markers are set),
    so no key is enqueued twice; paging is bounded by ``MAX_PAGES``. Rows with a
    failure streak go in messages of their own (``SUSPECTS_PER_BATCH``), after the
    tick's clean pages.
    """

    def find(plane: Plane, now: float, submit: Submit) -> int:
        plane.events.take(pass_name)  # what an event asks for from here on, the next scan finds
        limit = plane.settings.scan_limit
        enqueued = 0
        after = None
        suspects: list[int] = []
        for _ in range(MAX_PAGES):
            with plane.store.session(readonly=True) as s:
                rows = due(s, now=now, limit=limit, after=after)
            enqueued += len(submit(pass_name, [row.id for row in rows if not row.failures]))
            suspects += [row.id for row in rows if row.failures]
            if len(rows) < limit:
                break
            after = rows[-1]
        for start in range(0, len(suspects), SUSPECTS_PER_BATCH):  # behind every clean batch
            enqueued += len(submit(pass_name, suspects[start : start + SUSPECTS_PER_BATCH]))
        return enqueued

    return find

"""The one failure path: classify an error, record it on its own row, report it once.

Every pass and the runner go through here; what each class of error makes a pass do
(transient, lost race, protocol, capability, other) is docs/design.md section 6,
"Error classes", with the table of the classes.

Reports are logged once per distinct (pass, key, detail), with bounded
memory, and forgotten when the key succeeds, so a recurrence is seen again.
Rows of one batch that fail alike share one line (``expire rows 3, 4, 11
failed (1 in a row): …``); each row's own record holds its error.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext, suppress
from enum import StrEnum

from sqlalchemy.exc import DBAPIError

from core import logs
from core.db import is_transient
from core.errors import CapabilityError, LostRace, ProtocolError, TransientError
from core.retry import RetryPolicy
from store import audit, bookkeeping
from tasks.declaration import Key, Lock, Outcome, Pass
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")


class ErrorClass(StrEnum):
    TRANSIENT = "transient"
    LOST_RACE = "lost_race"
    PROTOCOL = "protocol"
    CAPABILITY = "capability"
    OTHER = "other"


def classify(err: BaseException) -> ErrorClass:
    if is_transient(err):
        return ErrorClass.TRANSIENT
    if isinstance(err, LostRace):
        return ErrorClass.LOST_RACE
    if isinstance(err, ProtocolError):
        return ErrorClass.PROTOCOL
    if isinstance(err, CapabilityError):
        return ErrorClass.CAPABILITY
    return ErrorClass.OTHER


class Reporter:
    """Logs a failure once per distinct (pass, key, detail); bounded memory; reset on success."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._seen: OrderedDict[tuple[str, str], str] = OrderedDict()

    def once(self, pass_name: str, key: str, detail: str, level: int = logging.WARNING) -> bool:
        """Log unless this exact detail was the last one reported for the key; True if logged."""
        slot = (pass_name, key)
        seen = self._seen.get(slot) == detail
        self._seen[slot] = detail
        self._seen.move_to_end(slot)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        if not seen:
            log.log(level, "%s %s: %s", pass_name, key, detail)
        return not seen

    def succeeded(self, pass_name: str, key: str) -> None:
        self._seen.pop((pass_name, key), None)

    def has(self, pass_name: str) -> bool:
        """Whether any key of the pass has a report on record (bounded scan of a small map)."""
        return any(name == pass_name for name, _ in self._seen)


reporter = Reporter()


def describe(err: BaseException) -> str:
    """The error as an operator reads it: a database's own error, not the SQL layer's wrapping
    (the statement and a link, the same for every row a storm's statement refuses)."""
    if isinstance(err, DBAPIError) and err.orig is not None:
        err = err.orig
    return f"{type(err).__name__}: {err}"


def handle(plane: Plane, p: Pass, key: Key, err: Exception, now: float) -> Outcome:
    """A non-transient failure of one key: what it comes to (recorded where it belongs)."""
    kind = classify(err)
    if kind is ErrorClass.LOST_RACE:
        return Outcome.LOST_RACE
    if kind is ErrorClass.PROTOCOL:
        reporter.once(p.name, p.key_name(key), f"deferred: {err}")
        return Outcome.DEFERRED
    return record(plane, p, [(key, err)], now, counts=True)[0]


def listed(names: Sequence[object], shown: int = 20) -> str:
    """``7``, ``7, 9, 12``, or the first ``shown`` and how many more: bounded, whatever the batch."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(map(str, names[:shown])) + more


def _rows(row_ids: list[int], shown: int = 20) -> str:
    """``row 7``, ``rows 7, 9, 12``, or the first ``shown`` and how many more."""
    return ("row " if len(row_ids) == 1 else "rows ") + listed(row_ids, shown)


def give_up(plane: Plane, p: Pass, key: Key, err: BaseException, now: float) -> Outcome:
    """Transient retries ran out: back the row off durably, without nearing quarantine.

    A key that held an ordinal reserved through its retries (a claim) gives it back.
    """
    from tasks import metrics  # prometheus_client: not for `poolctl status`, which reads PASSES

    if p.reserves is not None:
        with suppress(TransientError):  # else it lapses with its holder's hold
            plane.coord.release([p.reserves(key)])
    outcome = record(plane, p, [(key, err)], now, counts=False)[0]
    metrics.PASS_OUTCOMES.labels(p.name, outcome.value).inc()
    return outcome


def record(
    plane: Plane, p: Pass, failed: Sequence[tuple[Key, BaseException]], now: float, *, counts: bool
) -> list[Outcome]:
    """Record each failure on its own row: one transaction for all, each alone if that fails.

    A pass that does not work on rows has nowhere durable to record: its
    scanner finds the key again next tick, and the failure is reported once.
    """
    settled = Outcome.FAILED if counts else Outcome.RETRY_LATER
    level = logging.ERROR if counts else logging.WARNING
    if not failed:
        return []
    if p.lock is not Lock.ROW:
        for key, err in failed:
            with logs.bound(**p.log_ids(key)):
                reporter.once(p.name, p.key_name(key), describe(err), level)
        return [settled] * len(failed)
    policy = RetryPolicy.from_settings(plane.settings)
    errors = {int(key): describe(err) for key, err in failed}
    try:
        with plane.store.connection() as conn:
            got = bookkeeping.record_failures(
                conn, errors, policy=policy, now=now, counts=counts, actor=audit.by_pass(p.name)
            )
    except Exception as inner:
        if len(errors) == 1:  # this row cannot take the record (or the store is failing): report it
            [(key, err)] = failed
            with logs.bound(**p.log_ids(key)):
                reporter.once(p.name, str(key), f"{describe(err)} (unrecorded: {inner})", logging.ERROR)
            return [Outcome.FAILED]
        if not is_transient(inner):  # one row cannot take its record: each on its own, to find it
            return [o for key, err in failed for o in record(plane, p, [(key, err)], now, counts=counts)]
        # The store is busy or away: each row alone would wait as long, once per row.
        unrecorded: dict[str, list[int]] = {}
        for key, err in failed:
            unrecorded.setdefault(describe(err), []).append(int(key))
        for error, row_ids in unrecorded.items():
            with _about(row_ids):
                log.error("%s %s failed (unrecorded: %s): %s", p.name, _rows(row_ids), inner, error)
        return [Outcome.FAILED] * len(failed)
    alike: dict[tuple[str, str], list[int]] = {}  # one line per distinct report, not per row
    quarantined: dict[int, list[int]] = {}
    for row_id, f in got.items():
        if f.new_detail:
            streak = f"{f.failures} in a row" + (", quarantined" if f.quarantined else "")
            alike.setdefault((streak, errors[row_id]), []).append(row_id)
        elif f.newly_quarantined:  # the same error again: its line says so, not the error
            quarantined.setdefault(f.failures, []).append(row_id)
    for (streak, error), row_ids in alike.items():
        with _about(row_ids):
            log.log(level, "%s %s failed (%s): %s", p.name, _rows(row_ids), streak, error)
    for n, row_ids in quarantined.items():
        with _about(row_ids):
            log.log(
                level,
                "%s %s quarantined after %d failures in a row (poolctl requeue)",
                p.name,
                _rows(row_ids),
                n,
            )
    return [Outcome.QUARANTINED if counts and got[int(k)].quarantined else settled for k, _ in failed]


def _about(row_ids: list[int]) -> AbstractContextManager[None]:
    """A line about one row carries its id (``core.logs``); a line about several names them in its text."""
    return logs.bound(row_id=row_ids[0]) if len(row_ids) == 1 else nullcontext()

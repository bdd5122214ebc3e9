"""Run one key of one pass in isolation: its own lock, its own transactions, its own failure.

This is where the error classes decide what happens (SPEC "Error classes"):

- ``TransientError`` propagates to the caller, which retries the key with backoff;
- ``LostRace`` means another writer did it: skipped, silently;
- other ``ProtocolError``: deferred (a later reconcile fixes it), reported once;
- anything else is recorded on that row only (backoff, quarantine), reported
  once per distinct detail; the next key goes on regardless.

Capability errors are handled inside the pass that can park the run.
"""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from poolkeeper.errors import LostRace, ProtocolError, TransientError
from store import transitions
from tasks import expire, gc, lease_failures, materialize, metrics, reconcile, results
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")

Key = Any  # an int row id, a board name, or a claim dict
PassFn = Callable[[Plane, Any, float], str]

PASSES: dict[str, PassFn] = {
    "expire": expire.run,
    "lease_failures": lease_failures.run,
    "results": results.run,
    "reconcile": reconcile.run,
    "materialize": materialize.run,
    "gc": gc.run,
}
ROW_PASSES = ("expire", "lease_failures", "results")
QUIET = {"lost_race", "nothing", "no_evidence", "lock_busy"}


def key_name(pass_name: str, key: Key) -> str:
    """The key as it appears in lock and marker names and in logs."""
    if pass_name == "materialize":
        return materialize.claim_name(key)
    return str(key)


class Reporter:
    """Logs a failure once per distinct (pass, key, detail); bounded memory."""

    def __init__(self, size: int = 4096) -> None:
        self.size = size
        self._seen: OrderedDict[tuple[str, str], str] = OrderedDict()

    def once(self, pass_name: str, key: str, detail: str, level: int = logging.WARNING) -> None:
        slot = (pass_name, key)
        if self._seen.get(slot) == detail:
            self._seen.move_to_end(slot)
            return
        self._seen[slot] = detail
        self._seen.move_to_end(slot)
        while len(self._seen) > self.size:
            self._seen.popitem(last=False)
        log.log(level, "%s %s: %s", pass_name, key, detail)


reporter = Reporter()


def run_key(plane: Plane, pass_name: str, key: Key, now: float) -> str:
    """One key, under its lock. Raises ``TransientError`` for the caller to retry."""
    name = key_name(pass_name, key)
    lock_key = f"row:{name}" if pass_name in ROW_PASSES else f"{pass_name}:{name}"
    token = plane.coord.lock(lock_key)
    if token is None:
        metrics.LOCK_BUSY.labels(pass_name).inc()
        return _count(pass_name, "lock_busy")
    try:
        outcome = PASSES[pass_name](plane, key, now)
        if outcome not in QUIET:
            log.info("%s %s: %s", pass_name, name, outcome)
        return _count(pass_name, outcome)
    except (TransientError, SoftTimeLimitExceeded):
        raise
    except LostRace:
        return _count(pass_name, "lost_race")
    except ProtocolError as err:
        reporter.once(pass_name, name, f"deferred: {err}")
        return _count(pass_name, "deferred")
    except Exception as err:  # a bug or poisoned data: this key only
        return _count(pass_name, _record_failure(plane, pass_name, key, err, now, counts=True))
    finally:
        with suppress(TransientError):  # the lock expires by itself
            plane.coord.unlock(lock_key, token)


def give_up_transient(plane: Plane, pass_name: str, key: Key, err: BaseException, now: float) -> str:
    """Transient retries ran out: back the row off durably, without nearing quarantine."""
    return _count(pass_name, _record_failure(plane, pass_name, key, err, now, counts=False))


def _record_failure(
    plane: Plane, pass_name: str, key: Key, err: BaseException, now: float, *, counts: bool
) -> str:
    detail = f"{type(err).__name__}: {err}"
    name = key_name(pass_name, key)
    if pass_name not in ROW_PASSES:
        reporter.once(pass_name, name, detail, logging.ERROR if counts else logging.WARNING)
        return "failed" if counts else "retry_later"
    try:
        with plane.store.session() as s:
            failure = transitions.record_failure(
                s, int(key), detail, settings=plane.settings, now=now, counts=counts
            )
    except Exception as inner:  # the store itself is failing: the scanner finds the row again
        reporter.once(pass_name, name, f"{detail} (and could not record it: {inner})", logging.ERROR)
        return "failed"
    if failure.new_detail:
        log.log(
            logging.ERROR if counts else logging.WARNING,
            "%s row %s failed (%d in a row%s): %s",
            pass_name,
            name,
            failure.failures,
            ", quarantined" if failure.quarantined else "",
            detail,
        )
    if not counts:
        return "retry_later"
    return "quarantined" if failure.quarantined else "failed"


def _count(pass_name: str, outcome: str) -> str:
    metrics.PASS_OUTCOMES.labels(pass_name, outcome).inc()
    return outcome


@dataclass
class BatchResult:
    outcomes: Counter[str] = field(default_factory=Counter)
    transient: list[tuple[Key, TransientError]] = field(default_factory=list)
    done: list[Key] = field(default_factory=list)


def run_batch(plane: Plane, pass_name: str, keys: list[Key], now: float) -> BatchResult:
    """Every key on its own: a failing key never stops its neighbours."""
    result = BatchResult()
    for key in keys:
        try:
            result.outcomes[run_key(plane, pass_name, key, now)] += 1
            result.done.append(key)
        except TransientError as err:
            result.transient.append((key, err))
    return result

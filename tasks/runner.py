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
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded
from sqlalchemy import Connection

from poolkeeper.errors import LostRace, ProtocolError, TransientError
from store import transitions
from tasks import expire, gc, lease_failures, materialize, metrics, reconcile, results
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")

Key = Any  # an int row id, a board name, or a claim dict
PassFn = Callable[[Plane, Any, float], str]
ConnectionPassFn = Callable[[Connection, Plane, Any, float], str]

# Store-only passes: a batch shares one transaction, a savepoint per key.
CONNECTION_PASSES: dict[str, ConnectionPassFn] = {"expire": expire.run_in}
# Passes that talk to the board: each key in its own short transactions, none held across a board call.
PASSES: dict[str, PassFn] = {
    "lease_failures": lease_failures.run,
    "results": results.run,
    "reconcile": reconcile.run,
    "materialize": materialize.run,
    "gc": gc.run,
}
ROW_PASSES = ("expire", "lease_failures", "results")
QUIET = {"lost_race", "nothing", "lock_busy"}
# The everyday outcomes: one line per row only at DEBUG; the batch summary says how many.
ROUTINE = {"reoffered", "finalized", "added"}


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
    result = run_batch(plane, pass_name, [key], now)
    if result.transient:
        raise result.transient[0][1]
    return result.done[0][1]


def run_batch(plane: Plane, pass_name: str, keys: list[Key], now: float) -> BatchResult:
    """Every key on its own lock and with its own failure: one never stops its neighbours.

    Store-only passes share one transaction per batch with a savepoint per key
    (one commit instead of one per row); if that commit fails, every key of the
    batch comes back as transient and is retried alone.
    """
    result = BatchResult()
    names = [key_name(pass_name, k) for k in keys]
    lock_keys = [f"row:{n}" if pass_name in ROW_PASSES else f"{pass_name}:{n}" for n in names]
    try:
        tokens = plane.coord.lock_many(lock_keys)
    except TransientError as err:
        result.transient = [(k, err) for k in keys]
        return result
    mine = []
    for key, token in zip(keys, tokens, strict=True):
        if token is None:
            metrics.LOCK_BUSY.labels(pass_name).inc()
            result.finish(pass_name, key, "lock_busy")
        else:
            mine.append(key)
    try:
        if pass_name in CONNECTION_PASSES:
            _run_in_one_transaction(plane, pass_name, mine, now, result)
        else:
            for key in mine:
                _run_alone(plane, pass_name, key, now, result)
    finally:
        with suppress(TransientError):  # the locks expire by themselves
            plane.coord.unlock_many({lk: t for lk, t in zip(lock_keys, tokens, strict=True) if t})
    return result


def _run_alone(plane: Plane, pass_name: str, key: Key, now: float, result: BatchResult) -> None:
    try:
        outcome = PASSES[pass_name](plane, key, now)
    except TransientError as err:
        result.transient.append((key, err))
        return
    except Exception as err:
        outcome = _classify(plane, pass_name, key, err, now)
    result.finish(pass_name, key, outcome)


def _run_in_one_transaction(
    plane: Plane, pass_name: str, keys: list[Key], now: float, result: BatchResult
) -> None:
    run_in = CONNECTION_PASSES[pass_name]
    outcomes: list[tuple[Key, str]] = []
    failed: list[tuple[Key, BaseException]] = []
    try:
        with plane.store.connection() as conn:
            # A connection pass runs one statement per key. SQLite undoes a failed
            # statement by itself and keeps the transaction (statement atomicity),
            # which is the savepoint; other databases get an explicit SAVEPOINT.
            own_savepoint = conn.dialect.name != "sqlite"
            for key in keys:
                try:
                    with conn.begin_nested() if own_savepoint else nullcontext():
                        outcomes.append((key, run_in(conn, plane, key, now)))
                except (LostRace, ProtocolError) as err:
                    outcomes.append((key, _classify(plane, pass_name, key, err, now)))
                except (TransientError, SoftTimeLimitExceeded):
                    raise
                except Exception as err:  # rolled back to its savepoint; recorded after the commit
                    failed.append((key, err))
    except TransientError as busy:
        result.transient.extend((k, busy) for k in keys)
        return
    for key, outcome in outcomes:
        result.finish(pass_name, key, outcome)
    for (key, _), outcome in zip(
        failed, _record_failures(plane, pass_name, failed, now, counts=True), strict=True
    ):
        result.finish(pass_name, key, outcome)


def _classify(plane: Plane, pass_name: str, key: Key, err: Exception, now: float) -> str:
    if isinstance(err, SoftTimeLimitExceeded):
        raise err
    if isinstance(err, LostRace):
        return "lost_race"
    if isinstance(err, ProtocolError):
        reporter.once(pass_name, key_name(pass_name, key), f"deferred: {err}")
        return "deferred"
    return _record_failure(plane, pass_name, key, err, now, counts=True)


def give_up_transient(plane: Plane, pass_name: str, key: Key, err: BaseException, now: float) -> str:
    """Transient retries ran out: back the row off durably, without nearing quarantine."""
    outcome = _record_failure(plane, pass_name, key, err, now, counts=False)
    metrics.PASS_OUTCOMES.labels(pass_name, outcome).inc()
    return outcome


def _record_failure(
    plane: Plane, pass_name: str, key: Key, err: BaseException, now: float, *, counts: bool
) -> str:
    return _record_failures(plane, pass_name, [(key, err)], now, counts=counts)[0]


def _record_failures(
    plane: Plane, pass_name: str, failed: list[tuple[Key, BaseException]], now: float, *, counts: bool
) -> list[str]:
    """Record each failure on its own row (one transaction for all, a savepoint each)."""
    settled = "failed" if counts else "retry_later"
    level = logging.ERROR if counts else logging.WARNING
    if pass_name not in ROW_PASSES:
        for key, err in failed:
            reporter.once(pass_name, key_name(pass_name, key), f"{type(err).__name__}: {err}", level)
        return [settled] * len(failed)
    outcomes = []
    try:
        with plane.store.session() as s:
            for key, err in failed:
                detail = f"{type(err).__name__}: {err}"
                try:
                    with s.begin_nested():
                        f = transitions.record_failure(
                            s, int(key), detail, settings=plane.settings, now=now, counts=counts
                        )
                except Exception as inner:  # this row cannot even take the record: log it
                    reporter.once(pass_name, str(key), f"{detail} (unrecorded: {inner})", logging.ERROR)
                    outcomes.append("failed")
                    continue
                if f.new_detail:
                    quarantined = ", quarantined" if f.quarantined else ""
                    log.log(
                        level,
                        "%s row %s failed (%d in a row%s): %s",
                        pass_name,
                        key,
                        f.failures,
                        quarantined,
                        detail,
                    )
                outcomes.append("quarantined" if counts and f.quarantined else settled)
    except Exception as inner:  # the store itself is failing: the scanner finds the rows again
        for key, err in failed:
            reporter.once(
                pass_name, str(key), f"{type(err).__name__}: {err} (unrecorded: {inner})", logging.ERROR
            )
        return ["failed"] * len(failed)
    return outcomes


@dataclass
class BatchResult:
    done: list[tuple[Key, str]] = field(default_factory=list)
    transient: list[tuple[Key, TransientError]] = field(default_factory=list)

    @property
    def outcomes(self) -> Counter[str]:
        return Counter(outcome for _, outcome in self.done)

    def finish(self, pass_name: str, key: Key, outcome: str) -> None:
        metrics.PASS_OUTCOMES.labels(pass_name, outcome).inc()
        if outcome not in QUIET:
            level = logging.DEBUG if outcome in ROUTINE else logging.INFO
            log.log(level, "%s %s: %s", pass_name, key_name(pass_name, key), outcome)
        self.done.append((key, outcome))

    def summary(self) -> str:
        """``"reoffered=198 lock_busy=2"``, or empty when nothing happened worth a line."""
        counts = self.outcomes
        if not set(counts) - QUIET and not self.transient:
            return ""
        parts = [f"{k}={v}" for k, v in sorted(counts.items())]
        if self.transient:
            parts.append(f"transient={len(self.transient)}")
        return " ".join(parts)

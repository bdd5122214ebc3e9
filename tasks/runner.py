"""Run the keys of one pass in isolation: each its own lock, its own transactions, its own failure.

Failures go through ``tasks.failures`` (one path for every pass). A transient
failure comes back to the caller, which retries that key with backoff; any
other failure is this key's alone and the next key goes on regardless.

Store-only passes share one transaction per batch with a savepoint per key
(one commit instead of one per row); if that commit fails, every key of the
batch comes back as transient and is retried alone.
"""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import nullcontext, suppress
from dataclasses import dataclass, field

from core.errors import ProtocolError, TransientError
from tasks import failures, metrics, registry
from tasks.declaration import QUIET, ROUTINE, Key, Outcome, Pass
from tasks.failures import ErrorClass
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")

# Errors that must end the whole message, never count as one key's failure
# (the Celery entry point passes its soft time limit here).
Abort = tuple[type[BaseException], ...]


@dataclass
class BatchResult:
    p: Pass
    done: list[tuple[Key, Outcome]] = field(default_factory=list)
    transient: list[tuple[Key, BaseException]] = field(default_factory=list)

    @property
    def outcomes(self) -> Counter[Outcome]:
        return Counter(outcome for _, outcome in self.done)

    def finish(self, key: Key, outcome: Outcome) -> None:
        metrics.PASS_OUTCOMES.labels(self.p.name, outcome.value).inc()
        name = self.p.key_name(key)
        if outcome not in QUIET:
            level = logging.DEBUG if outcome in ROUTINE else logging.INFO
            log.log(level, "%s %s: %s", self.p.name, name, outcome)
        if outcome not in (Outcome.FAILED, Outcome.QUARANTINED, Outcome.DEFERRED, Outcome.RETRY_LATER):
            failures.reporter.succeeded(self.p.name, name)
        self.done.append((key, outcome))

    def summary(self) -> str:
        """``"reoffered=198 lock_busy=2"``, or empty when nothing happened worth a line."""
        counts = self.outcomes
        if not set(counts) - QUIET and not self.transient:
            return ""
        parts = [f"{k.value}={v}" for k, v in sorted(counts.items())]
        if self.transient:
            parts.append(f"transient={len(self.transient)}")
        return " ".join(parts)


def run_key(plane: Plane, pass_name: str, key: Key, now: float) -> Outcome:
    """One key, under its lock. Raises the transient error for the caller to retry."""
    result = run_batch(plane, pass_name, [key], now)
    if result.transient:
        raise result.transient[0][1]
    return result.done[0][1]


def run_batch(plane: Plane, pass_name: str, keys: list[Key], now: float, abort: Abort = ()) -> BatchResult:
    """Every key on its own lock and with its own failure: one never stops its neighbours."""
    p = registry.get(pass_name)
    result = BatchResult(p)
    lock_names = [p.lock_name(k) for k in keys]
    try:
        tokens = plane.coord.lock_many(lock_names)
    except TransientError as err:
        result.transient = [(k, err) for k in keys]
        return result
    mine = []
    for key, token in zip(keys, tokens, strict=True):
        if token is None:
            metrics.LOCK_BUSY.labels(p.name).inc()
            result.finish(key, Outcome.LOCK_BUSY)
        else:
            mine.append(key)
    try:
        if p.store_only:
            _run_in_one_transaction(plane, p, mine, now, result, abort)
        else:
            for key in mine:
                _run_alone(plane, p, key, now, result, abort)
    finally:
        with suppress(TransientError):  # the locks expire by themselves
            plane.coord.unlock_many({n: t for n, t in zip(lock_names, tokens, strict=True) if t})
    return result


def _run_alone(plane: Plane, p: Pass, key: Key, now: float, result: BatchResult, abort: Abort) -> None:
    assert p.run is not None
    try:
        outcome = p.run(plane, key, now)
    except abort:
        raise
    except Exception as err:
        if failures.classify(err) is ErrorClass.TRANSIENT:
            result.transient.append((key, err))
            return
        outcome = failures.handle(plane, p, key, err, now)
    result.finish(key, outcome)


def _run_in_one_transaction(
    plane: Plane, p: Pass, keys: list[Key], now: float, result: BatchResult, abort: Abort
) -> None:
    assert p.run_in is not None
    outcomes: list[tuple[Key, Outcome]] = []
    failed: list[tuple[Key, BaseException]] = []
    try:
        with plane.store.connection() as conn:
            # One statement per key. SQLite undoes a failed statement by itself and
            # keeps the transaction (statement atomicity), which is the savepoint;
            # other databases get an explicit SAVEPOINT.
            own_savepoint = conn.dialect.name != "sqlite"
            for key in keys:
                try:
                    with conn.begin_nested() if own_savepoint else nullcontext():
                        outcomes.append((key, p.run_in(conn, plane, key, now)))
                except ProtocolError as err:
                    outcomes.append((key, failures.handle(plane, p, key, err, now)))
                except TransientError:
                    raise
                except abort:
                    raise
                except Exception as err:  # rolled back to its savepoint; recorded after the commit
                    if failures.classify(err) is ErrorClass.TRANSIENT:
                        raise  # the transaction may be gone: the whole batch is retried
                    failed.append((key, err))
    except TransientError as busy:
        result.transient.extend((k, busy) for k in keys)
        return
    for key, outcome in outcomes:
        result.finish(key, outcome)
    for (key, _), outcome in zip(failed, failures.record(plane, p, failed, now, counts=True), strict=True):
        result.finish(key, outcome)

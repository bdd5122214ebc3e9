"""Run the keys of one pass in isolation: each its own lock, its own transactions, its own failure.

Failures go through ``tasks.failures`` (one path for every pass). A transient
failure comes back to the caller, which retries that key with backoff; any
other failure is this key's alone and the next key goes on regardless.

Store-only passes take a whole batch in one transaction with one set-based
statement (one commit and one statement instead of one per row); where the
statement fails it is split in parts down to the failing keys (``core.isolate``), so a
poisoned row never fails its neighbours. If the commit fails, every key of
the batch comes back as transient and is retried alone.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass, field

from sqlalchemy import Connection

from core import db, logs
from core.errors import ProtocolError, TransientError
from core.isolate import isolate
from tasks import failures, metrics, registry
from tasks.declaration import QUIET, Key, Outcome, Pass
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
        self.done.append((key, outcome))

    def report(self) -> None:
        """Metrics by outcome (one update per outcome, not per key); one line per outcome naming its keys.

        ``results 17: finalized``, ``expire 3, 4, 11: reoffered``: every outcome that changed
        something names what it changed, in one line per outcome of the batch (a storm's
        lists the first keys and how many more); quiet outcomes (nothing happened) log nothing.
        """
        counts = self.outcomes
        for outcome, n in counts.items():
            metrics.PASS_OUTCOMES.labels(self.p.name, outcome.value).inc(n)
        reported = failures.reporter.has(self.p.name)
        if not set(counts) - QUIET and not reported:
            return  # the everyday case of a storm: nothing to name, nothing to forget
        named: dict[Outcome, list[Key]] = {}
        for key, outcome in self.done:
            if outcome in UNSETTLED:
                continue  # tasks.failures reported it, once, with its error
            if outcome not in QUIET:
                named.setdefault(outcome, []).append(key)
            if reported:
                failures.reporter.succeeded(self.p.name, self.p.key_name(key))
        for outcome, keys in named.items():
            with logs.bound(**(self.p.log_ids(keys[0]) if len(keys) == 1 else {})):  # one key: its ids
                log.info(
                    "%s %s: %s", self.p.name, failures.listed([self.p.key_name(k) for k in keys]), outcome
                )


# Outcomes that leave the key's failure streak open: its report is not forgotten.
UNSETTLED = frozenset({Outcome.FAILED, Outcome.QUARANTINED, Outcome.DEFERRED, Outcome.RETRY_LATER})


def run_key(plane: Plane, pass_name: str, key: Key, now: float) -> Outcome:
    """One key, under its lock. Raises the transient error for the caller to retry."""
    result = run_batch(plane, pass_name, [key], now)
    if result.transient:
        raise result.transient[0][1]
    return result.done[0][1]


# Given a batch's result, before its locks go: the keys whose pending markers go with them.
Settle = Callable[["BatchResult"], list[Key]]


def run_batch(
    plane: Plane,
    pass_name: str,
    keys: list[Key],
    now: float,
    abort: Abort = (),
    settle: Settle | None = None,
) -> BatchResult:
    """Every key on its own lock and with its own failure: one never stops its neighbours.

    With ``settle`` (the Celery task's), the markers of the keys it returns are cleared in
    the same round trip that lets the locks go (``Coordination.finish``).
    """
    p = registry.get(pass_name)
    result = BatchResult(p)
    lock_names = [p.lock_name(k) for k in keys]
    try:
        tokens = plane.coord.lock_many(lock_names)
    except TransientError as err:
        result.transient = [(k, err) for k in keys]
        if settle is not None:  # each key is retried (or given up) as any transient one
            settle(result)
        return result
    mine, busy = [], []
    cleared: list[str] = []
    for key, token in zip(keys, tokens, strict=True):
        if token is None:
            metrics.LOCK_BUSY.labels(p.name).inc()
            result.finish(key, Outcome.LOCK_BUSY)
            busy.append(key)
        else:
            mine.append(key)
    try:
        if busy and p.reserves is not None:
            _give_back(plane, p.reserves, busy)
        if p.store_only:
            _run_in_one_transaction(plane, p, mine, now, result, abort)
        else:
            for key in mine:
                _run_alone(plane, p, key, now, result, abort)
        if settle is not None:
            cleared = [p.key_name(k) for k in settle(result)]
    finally:
        try:
            plane.coord.finish({n: t for n, t in zip(lock_names, tokens, strict=True) if t}, p.name, cleared)
        except TransientError as err:  # the locks and markers expire by themselves
            if cleared:
                log.warning("%s: pending markers left to expire: %s", p.name, err)
        result.report()
    return result


def _give_back(plane: Plane, reserves: Callable[[Key], int], keys: list[Key]) -> None:
    """A key that did not run gives its reservation back: only a row may keep an ordinal.

    (Its lock's holder is a duplicate, or dead: a live duplicate that loses its
    reservation so can at worst meet ``OrdinalTaken``, deferred to reconcile.)
    """
    with suppress(TransientError):  # else it lapses with its holder's hold
        plane.coord.release(reserves(k) for k in keys)


def _run_alone(plane: Plane, p: Pass, key: Key, now: float, result: BatchResult, abort: Abort) -> None:
    assert p.run is not None
    with logs.bound(**p.log_ids(key)):  # what the pass and its failure log is about this key
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
    """The whole batch in one transaction: one set statement, split only where it fails."""
    if not keys:
        return
    try:
        with plane.store.connection() as conn:
            done, failed = _apply(conn, plane, p, keys, now, abort)
    except TransientError as busy:
        result.transient.extend((k, busy) for k in keys)
        return
    result.done.extend(done)
    recorded = failures.record(plane, p, failed, now, counts=True)
    result.done.extend(zip([k for k, _ in failed], recorded, strict=True))


def _apply(
    conn: Connection, plane: Plane, p: Pass, keys: list[Key], now: float, abort: Abort
) -> tuple[list[tuple[Key, Outcome]], list[tuple[Key, Exception]]]:
    """Apply the pass to ``keys`` at once, else in parts down to the failing keys (``core.isolate``).

    Each attempt runs under a SAVEPOINT, on every database: a pass's work is
    several statements (the transition, its audit events, its children's
    retirement), and a failure in a later one must undo the earlier ones, which
    one statement's own atomicity would not. So the healthy neighbours of a
    poisoned row still commit whole, each key's outcome is its own, and the
    poisoned row is recorded alone, unchanged. A pass may also name the error
    that refused a key as that key's outcome (``expire`` does): it is the key's
    failure, as if its part had failed alone.
    """
    assert p.run_in is not None
    run_in = p.run_in

    def attempt(part: Sequence[Key]) -> list[tuple[Key, Outcome | Exception]]:
        with db.savepoint(conn):
            got = run_in(conn, plane, list(part), now)
        return [(k, got.get(k, Outcome.LOST_RACE)) for k in part]

    def goes_up(err: BaseException) -> bool:  # the transaction may be gone: the batch is retried
        return isinstance(err, abort) or failures.classify(err) is ErrorClass.TRANSIENT

    parts, failed = isolate(keys, attempt, goes_up=goes_up)
    done: list[tuple[Key, Outcome]] = []
    recorded_later: list[tuple[Key, Exception]] = []
    for key, outcome in [*(pair for part in parts for pair in part), *failed]:
        if not isinstance(outcome, Exception):
            done.append((key, outcome))
        elif isinstance(outcome, ProtocolError):
            done.append((key, failures.handle(plane, p, key, outcome, now)))
        else:
            recorded_later.append((key, outcome))  # recorded on its row after the commit
    return done, recorded_later

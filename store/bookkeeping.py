"""Durable maintenance bookkeeping of one row: failures, backoff, quarantine.

A failed maintenance step is noted on its own row (never on a neighbour), so
backoff survives restarts, scanners skip the row until it is due, and an
operator sees the error. Any transition of the row clears the record
(``store.rows.CLEAR_BOOKKEEPING``). Each recorded failure is an audit event:
``failure``, or ``quarantine`` for the one that reaches the threshold.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast

from sqlalchemy import Connection, Table, bindparam, select
from sqlalchemy.orm import Session

from core import db, validate
from core.errors import LostRace, NotFound
from core.retry import RetryPolicy
from store import audit
from store.models import Assignment, EventKind

A = Assignment
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Failure:
    failures: int
    quarantined: bool
    next_attempt_at: float
    new_detail: bool  # the error differs from the one already on record: worth a log line
    newly_quarantined: bool = False  # this failure reached the threshold: worth a line too


def record_failures(
    s: Session | Connection,
    errors: Mapping[int, str],
    *,
    policy: RetryPolicy,
    now: float,
    counts: bool = True,
    rng: random.Random | None = None,
    actor: str = audit.UNATTRIBUTED,
) -> dict[int, Failure]:
    """Note a failed maintenance step on each row: backoff with jitter, quarantine at the threshold.

    ``counts=False`` is for transient trouble (busy board, lost connection): it
    delays the row without bringing it nearer quarantine. One read of all the
    rows, then one guarded UPDATE per row (a prebuilt statement, executed as a
    batch), and their events (one more batch). A row that no longer exists is
    ``NotFound``; one that changed under us (its state or failure count moved)
    is a ``LostRace``.
    """
    if not errors:
        return {}
    conn = db.connection_of(s)
    t = _TABLE.c
    read = select(t.id, t.state, t.attempt, t.fence, t.failures, t.last_error, t.quarantined).where(
        t.id.in_(list(errors))
    )
    found = {r.id: r for r in conn.execute(read)}
    missing = sorted(set(errors) - set(found))
    if missing:
        raise NotFound(f"row {missing[0]}: no such row")
    params, got, events = [], {}, []
    for row_id, error in errors.items():
        row = found[row_id]
        error = validate.storable(error, MAX_ERROR_CHARS)
        failures = row.failures + 1 if counts else row.failures
        delay, quarantined = policy.delay(failures, rng)
        newly = quarantined and not row.quarantined
        got[row_id] = Failure(failures, quarantined, now + delay, row.last_error != error, newly)
        kind = EventKind.QUARANTINE if newly else EventKind.FAILURE
        events.append(audit.Event(row_id, kind, actor, row.state, row.state, row.attempt, row.fence, error))
        params.append(
            {
                "row_id": row_id,
                "expect_state": row.state,
                "expect_failures": row.failures,
                "to_failures": failures,
                "to_error": error,
                "to_next": now + delay,
                "to_quarantined": quarantined,
            }
        )
    if conn.execute(_RECORD, params).rowcount != len(params):
        raise LostRace(f"record failure: one of rows {sorted(errors)} changed under us")
    audit.append(conn, events, now=now)
    return got


def record_failure(
    s: Session | Connection,
    row_id: int,
    error: str,
    *,
    policy: RetryPolicy,
    now: float,
    counts: bool = True,
    rng: random.Random | None = None,
    actor: str = audit.UNATTRIBUTED,
) -> Failure:
    """``record_failures`` of one row."""
    got = record_failures(s, {row_id: error}, policy=policy, now=now, counts=counts, rng=rng, actor=actor)
    return got[row_id]


_TABLE = cast(Table, A.__table__)
_RECORD = (
    _TABLE.update()
    .where(
        _TABLE.c.id == bindparam("row_id"),
        _TABLE.c.state == bindparam("expect_state"),
        _TABLE.c.failures == bindparam("expect_failures"),
    )
    .values(
        failures=bindparam("to_failures"),
        last_error=bindparam("to_error"),
        next_attempt_at=bindparam("to_next"),
        quarantined=bindparam("to_quarantined"),
    )
)

"""Durable maintenance bookkeeping of one row: failures, backoff, quarantine.

A failed maintenance step is noted on its own row (never on a neighbour), so
backoff survives restarts, scanners skip the row until it is due, and an
operator sees the error. Any transition of the row clears the record
(``store.rows.CLEAR_BOOKKEEPING``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sqlalchemy.orm import Session

from core.retry import RetryPolicy
from store.models import Assignment
from store.rows import get_row, guarded

A = Assignment
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class Failure:
    failures: int
    quarantined: bool
    next_attempt_at: float
    new_detail: bool  # the error differs from the one already on record: worth a log line


def record_failure(
    s: Session,
    row_id: int,
    error: str,
    *,
    policy: RetryPolicy,
    now: float,
    counts: bool = True,
    rng: random.Random | None = None,
) -> Failure:
    """Note a failed maintenance step on one row: backoff with jitter, quarantine at the threshold.

    ``counts=False`` is for transient trouble (busy board, lost connection): it
    delays the row without bringing it nearer quarantine.
    """
    row = get_row(s, row_id)
    error, previous = error[:MAX_ERROR_CHARS], row.last_error  # the UPDATE below refreshes ``row``
    failures = row.failures + 1 if counts else row.failures
    delay, quarantined = policy.delay(failures, rng)
    guarded(
        s,
        row_id,
        "record failure",
        {A.state: row.state, A.failures: row.failures},
        failures=failures,
        last_error=error,
        next_attempt_at=now + delay,
        quarantined=quarantined,
    )
    return Failure(failures, quarantined, now + delay, new_detail=previous != error)

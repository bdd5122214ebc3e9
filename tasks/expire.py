"""Expire lease.

Qualifies: a ``running`` row whose lease ended (``0 < lease_until < now``) and
whose maintenance backoff has run out.
Does: fences the holder out. Below the last attempt the row goes back to
``assigned`` with ``attempt + 1`` on the same ordinal, so the ordinal's
(restarted) worker is offered the same run under a new fence; after the last
attempt it becomes ``lease_failed`` and its ordinal is released.
Evidence: the store's own lease; the update is conditional on the row still
running with an ended lease, so a duplicate message or a late heartbeat can
never apply twice.
Store-only: a batch of rows is one prebuilt set-based UPDATE on the batch's
connection; a row the database refuses is split out by the statement alone
(``store.transitions.expire_many``) and recorded as that row's failure.
Returns: ``reoffered`` or ``lease_failed`` per row (``lost_race`` if it moved on).
"""

from __future__ import annotations

from sqlalchemy import Connection

from store import audit, queries, transitions
from store.models import RowState
from tasks import metrics
from tasks.declaration import Lock, Outcome, Pass, due_rows
from tasks.plane import Plane


def run_in(conn: Connection, plane: Plane, row_ids: list[int], now: float) -> dict[int, Outcome | Exception]:
    got = transitions.expire_many(
        conn, row_ids, max_attempts=plane.settings.max_attempts, now=now, actor=ACTOR
    )
    observe = metrics.EXPIRY_TO_REOFFER.observe
    outcomes: dict[int, Outcome | Exception] = dict(got.refused)  # each a failure of its own row
    for row_id, (state, lease_until) in got.moved.items():
        observe(max(0.0, now - lease_until))
        outcomes[row_id] = Outcome.REOFFERED if state is RowState.ASSIGNED else Outcome.LEASE_FAILED
    return outcomes


PASS = Pass(
    name="expire",
    lock=Lock.ROW,
    interval=lambda s: s.tick_seconds,
    find=due_rows("expire", queries.due_expired),
    run_in=run_in,
)
ACTOR = audit.by_pass(PASS.name)  # built once: every batch of a storm names it

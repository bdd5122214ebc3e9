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
This pass touches only the store, so a batch of rows shares one transaction
with a savepoint per row (see ``tasks.runner``); it runs Core statements on
the batch's connection.
Returns: ``"reoffered"`` or ``"lease_failed"`` (``LostRace`` if the row moved on).
"""

from __future__ import annotations

from sqlalchemy import Connection

from store import queries, transitions
from store.models import RowState
from tasks import metrics
from tasks.plane import Plane


def due(plane: Plane, now: float, limit: int, offset: int = 0) -> list[int]:
    with plane.store.session(readonly=True) as s:
        return queries.due_expired(s, now=now, limit=limit, offset=offset)


def run_in(conn: Connection, plane: Plane, row_id: int, now: float) -> str:
    expiry = transitions.expire(conn, row_id, max_attempts=plane.settings.max_attempts, now=now)
    metrics.EXPIRY_TO_REOFFER.observe(max(0.0, now - expiry.lease_until))
    return "reoffered" if expiry.state is RowState.ASSIGNED else "lease_failed"

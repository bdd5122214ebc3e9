"""Expire lease.

Qualifies: a ``running`` row whose lease ended (``0 < lease_until < now``) and
whose maintenance backoff has run out.
Does: fences the holder out. Below the last attempt the row goes back to
``assigned`` with ``attempt + 1`` on the same ordinal, so the ordinal's
(restarted) worker is offered the same run under a new fence; after the last
attempt it becomes ``lease_failed`` and its ordinal is released.
Evidence: the store's own lease; the update is conditional on state, attempt
and fence, so a duplicate message or a late heartbeat can never apply twice.
Returns: ``"reoffered"`` or ``"lease_failed"`` (``LostRace`` if the row moved on).
"""

from __future__ import annotations

from store import queries, transitions
from store.models import RowState
from tasks import metrics
from tasks.plane import Plane


def due(plane: Plane, now: float, limit: int) -> list[int]:
    with plane.store.session(readonly=True) as s:
        return queries.due_expired(s, now=now, limit=limit)


def run(plane: Plane, row_id: int, now: float) -> str:
    with plane.store.session() as s:
        lease_until = transitions.get_row(s, row_id).lease_until or now
        new_state = transitions.expire(s, row_id, max_attempts=plane.settings.max_attempts, now=now)
    metrics.EXPIRY_TO_REOFFER.observe(max(0.0, now - lease_until))
    return "reoffered" if new_state is RowState.ASSIGNED else "lease_failed"

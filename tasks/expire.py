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

from core import tracing
from store import audit, queries, transitions
from store.models import RowState
from tasks.declaration import Lock, Outcome, Pass, due_rows
from tasks.plane import Plane


def run_in(conn: Connection, plane: Plane, row_ids: list[int], now: float) -> dict[int, Outcome | Exception]:
    from tasks import metrics  # prometheus_client: not for `poolctl status`, which reads PASSES

    got = transitions.expire_many(
        conn, row_ids, max_attempts=plane.settings.max_attempts, now=now, actor=ACTOR
    )
    observe = metrics.EXPIRY_TO_REOFFER.observe
    outcomes: dict[int, Outcome | Exception] = dict(got.refused)  # each a failure of its own row
    for row_id, (state, lease_until) in got.moved.items():
        observe(max(0.0, now - lease_until))
        outcomes[row_id] = Outcome.REOFFERED if state is RowState.ASSIGNED else Outcome.LEASE_FAILED
    if tracing.enabled() and got.moved:
        _traced(conn, {k: v for k, v in outcomes.items() if k in got.moved}, now)
    return outcomes


def _traced(conn: Connection, moved: dict[int, Outcome | Exception], now: float) -> None:
    """A span per expired row in its run's trace (the re-offer's grant follows in the same trace);
    in a storm, one span for the batch linked to the first ``LINKS`` runs', at a fraction of the cost."""
    if len(moved) > SPAN_EACH_UPTO:
        links = list(queries.traceparents(conn, list(moved), limit=LINKS).values())
        with tracing.span("expire batch", None, {"pool.rows": len(moved)}, links=links, start=now):
            return
    found = queries.traceparents(conn, list(moved))
    for row_id, traceparent in found.items():
        ids = {"pool.row_id": row_id, "pool.outcome": str(moved[row_id])}
        with tracing.span("expire", traceparent, ids, start=now):
            pass


# Up to this many expiries in a batch, each is a span of its own run's trace (the everyday case);
# more (a storm: a fleet died) are one span with a link to each run, so tracing costs the storm
# what links cost (bench/storm.py --trace), not thousands of spans.
SPAN_EACH_UPTO = 8
LINKS = 128  # the SDK's default cap of links per span (OTEL_SPAN_LINK_COUNT_LIMIT): more would be dropped


PASS = Pass(
    name="expire",
    lock=Lock.ROW,
    interval=lambda s: s.tick_seconds,
    find=due_rows("expire", queries.due_expired),
    run_in=run_in,
)
ACTOR = audit.by_pass(PASS.name)  # built once: every batch of a storm names it

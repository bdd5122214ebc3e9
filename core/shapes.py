"""The wire's shapes, declared once: each name's length, each number's range, and the grant.

Whatever crosses a wire (the worker protocol, the board API) and lands in a column is
bounded here. The store's and the board's checks and columns, the protocol's models
(``poolkeeper.api.models``), the worker client's ``Grant``, the HTTP board's bodies
(``board.http``) and the board server's parameters read these; none states a bound of
its own. It is on the ground floor because the board never sees the store, and the
worker host (a pool worker's process) does not load it: ``store.Offer`` is ``Offer`` here.

A name is 1 to ``*_CHARS`` characters of ``core.validate.NAME_RE``; a range is inclusive.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from core.validate import INT32_MAX, INT64_MAX, MAX_POOL_SIZE

# The APIs' OpenAPI titles: a client told the wrong server's address names what answers there.
WIRE_API_TITLE = "poolkeeper wire protocol"  # poolctl serve
BOARD_API_TITLE = "poolkeeper board API"  # poolctl board serve

# Names, each as wide as its column
BOARD_CHARS = 64  # a board's name
SKIP_BOARDS = 1000  # boards one claim may skip (those paused on their own)
TASK_ID_CHARS = 128  # a task's id on its board
LANE_CHARS = 64
ASSIGNEE_CHARS = 64  # whom a board task is claimed for
BLOCK_KIND_CHARS = 32  # what kind of block parks a task
REQUEST_ID_CHARS = 128  # a claim request's id (a retried claim sends it again)
DELIVERY_ID_CHARS = 128  # a worker's delivery (a retried delivery sends it again)
OWNER_CHARS = 128  # the worker instance a grant is offered to
KEY_CHARS = 128  # a child registration's idempotency key
REASON_CHARS = 4096  # a blocked result's reason, as the board shows it


class Range(NamedTuple):
    """An integer's bounds, inclusive: ``validate.integer(field, value, *RANGE)``, or
    ``Field(ge=RANGE.low, le=RANGE.high)``."""

    low: int
    high: int


ROW_ID = Range(1, INT32_MAX)  # an ``Integer`` primary key
RUN_ID = Range(1, INT64_MAX)
ATTEMPT = Range(1, INT32_MAX)
FENCE = Range(1, INT64_MAX)  # also a child's epoch: its grant's fence
ORDINAL = Range(0, MAX_POOL_SIZE - 1)  # a pool narrows it to 0..POOL_SIZE-1


PROTOCOL_VERSION = 1  # of the grant and envelope shapes; the wire protocol reports it


@dataclass(frozen=True)
class Offer:
    """A grant: an ordinal's run, as handed to the worker instance (``owner``) that asked."""

    row_id: int
    board: str
    task_id: str
    run_id: int
    ordinal: int
    owner: str
    attempt: int
    fence: int
    lease_until: float
    payload: dict[str, Any]
    payload_digest: str
    protocol_version: int = PROTOCOL_VERSION
    traceparent: str | None = None  # the grant's span (W3C), its worker's parent; null with tracing off

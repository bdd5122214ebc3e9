"""The routes of child executions under a grant: ``/v1/children`` (docs/design.md, "Lineage").

A child call uses the token of its run's ordinal, or the grant's child token: the body's
dependency checks it (``deps.holder_of``) before the store is called. A child token is
refused on every other route (``deps.not_a_child``).
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations.
from typing import Annotated

from fastapi import APIRouter, Depends

from poolkeeper.api.deps import AuthFirst, Caller, Pool, Write, holder_of
from poolkeeper.api.models import (
    Child,
    ChildHeartbeat,
    ChildHeartbeatResponse,
    ChildRegistration,
    ChildResult,
    DeliveryResponse,
    VanishedChild,
    VanishedResponse,
)
from poolkeeper.api.protocol import WORKER_REFUSALS
from store import lineage

router = APIRouter(
    prefix="/v1/children", tags=["child executions"], responses=WORKER_REFUSALS, route_class=AuthFirst
)


def _registration(body: ChildRegistration, who: Caller, pool: Pool) -> ChildRegistration:
    holder_of(pool, body.row_id, body.fence, "row_id", who)
    return body


def _vanished(body: VanishedChild, who: Caller, pool: Pool) -> VanishedChild:
    holder_of(pool, body.row_id, body.fence, "row_id", who)
    return body


def _beat(body: ChildHeartbeat, who: Caller, pool: Pool) -> ChildHeartbeat:
    holder_of(pool, lineage.row_of(body.child_id), body.epoch, "child_id", who)
    return body


def _result(body: ChildResult, who: Caller, pool: Pool) -> ChildResult:
    holder_of(pool, lineage.row_of(body.child_id), body.epoch, "child_id", who)
    return body


@router.post("", response_model=Child)
def register_child(
    body: Annotated[ChildRegistration, Depends(_registration)], pool: Pool, write: Write
) -> Child:
    """Register a child under the holder's grant (or a live child of it); ``key``: idempotent."""
    got = write(pool.register_child, body.model_dump(exclude_none=True))
    return Child(
        child_id=got.id, epoch=got.epoch, row_id=got.row_id, parent_id=got.parent_id, depth=got.depth
    )


@router.post("/heartbeat", response_model=ChildHeartbeatResponse)
def child_heartbeat(
    body: Annotated[ChildHeartbeat, Depends(_beat)], pool: Pool, write: Write
) -> ChildHeartbeatResponse:
    """A child is alive (``registered`` → ``running``); stale once it or its parent's grant ended."""
    return ChildHeartbeatResponse(outcome=write(pool.child_heartbeat, body.model_dump(exclude_none=True)))


@router.post("/result", response_model=DeliveryResponse)
def child_result(
    body: Annotated[ChildResult, Depends(_result)], pool: Pool, write: Write
) -> DeliveryResponse:
    """A child's result: it and its live descendants turn terminal; the same result is a duplicate."""
    return DeliveryResponse(outcome=write(pool.child_result, body.model_dump()))


@router.post("/vanished", response_model=VanishedResponse)
def child_vanished(
    body: Annotated[VanishedChild, Depends(_vanished)], pool: Pool, write: Write
) -> VanishedResponse:
    """The holder lost a live child's worker: it and its live descendants turn ``unknown``."""
    return VanishedResponse(unknown=write(pool.child_vanished, body.model_dump()))

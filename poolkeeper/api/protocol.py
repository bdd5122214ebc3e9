"""The worker protocol's routes: offer, heartbeat, result, release (docs/design.md, "Wire protocol").

Each is one ``PoolStore`` call; ``errors.install`` answers its refusals by class. The
body's dependency checks that the token acts for the ordinal the body names before
the store is called. A heartbeat's or release's envelope reaches the store as the
models validated it (``Envelope.checked``), not dumped and parsed again; a result's
envelope too (``ResultEnvelope.checked``), its payload checked once more by the store's
rule for a document (``validate.document``: size, depth, credential-like keys).
Handlers are plain functions, so FastAPI runs them in its thread pool and the event
loop keeps serving others while one waits on the store; but a heartbeat waits on the
group commit (``group``), which writes in its own thread, so its handler awaits it on
the loop, with no trip through the thread pool.
"""

# No ``from __future__ import annotations``: FastAPI reads the endpoints' annotations.
import time
from dataclasses import replace
from typing import Annotated

from fastapi import APIRouter, Depends, Request
from starlette.concurrency import run_in_threadpool

from core import logs, tracing
from poolkeeper import tokens
from poolkeeper.api.deps import (
    AuthFirst,
    Caller,
    Heartbeats,
    PlaneEvents,
    Pool,
    Secret,
    Waits,
    Write,
    worker_of,
)
from poolkeeper.api.models import (
    DeliveryResponse,
    Envelope,
    Grant,
    OfferRequest,
    OfferResponse,
    ReleaseResponse,
    ResultEnvelope,
)
from poolkeeper.http.errors import refusals

WORKER_REFUSALS = refusals(403, 404, 408, 409, 503)
router = APIRouter(prefix="/v1", tags=["worker protocol"], responses=WORKER_REFUSALS, route_class=AuthFirst)


# The dependencies run in the request's own task: the ids they attach are on every line the
# request logs, its access line too (``core.logs.attach``), and on no other request's.


async def _asked(body: OfferRequest, who: Caller) -> OfferRequest:
    worker_of(body.ordinal, who)
    logs.attach(ordinal=body.ordinal)
    return body


async def _envelope(body: Envelope, who: Caller) -> Envelope:
    worker_of(body.worker_ordinal, who)
    _attach(body)
    return body


async def _result(body: ResultEnvelope, who: Caller) -> ResultEnvelope:
    worker_of(body.worker_ordinal, who)
    _attach(body)
    return body


def _attach(body: Envelope) -> None:
    logs.attach(task_id=body.task_id, run_id=body.run_id, ordinal=body.worker_ordinal, fence=body.fence)


OwnEnvelope = Annotated[Envelope, Depends(_envelope)]


@router.post("/offer", response_model=OfferResponse)
async def offer(
    request: Request,
    body: Annotated[OfferRequest, Depends(_asked)],
    pool: Pool,
    write: Write,
    key: Secret,
    waits: Waits,
    events: PlaneEvents,
) -> OfferResponse:
    """Take the ordinal's grant: its assigned run, under a new fence; ``grant: null`` when none has
    come within ``wait`` seconds (``waits``: answered as soon as the plane assigns one)."""
    deadline = time.monotonic() + min(body.wait, waits.longest)
    asked = False
    while True:
        woken = waits.event(body.ordinal)  # before the store is asked: a run assigned meanwhile wakes it
        if asked and await request.is_disconnected():  # a dead worker is granted nothing
            return OfferResponse(grant=None, lease_seconds=pool.lease_seconds)
        asked_at = time.time()
        got = await run_in_threadpool(write, pool.offer, body.ordinal, owner=body.owner)
        left = deadline - time.monotonic()
        if got is not None or left <= 0 or waits.stopped:
            break
        if not asked:  # an idle worker is here: ready tasks may be claimed for its ordinal now
            await run_in_threadpool(events.scan_due, "materialize")
            asked = True
        await waits.wait(woken, left)
    if got is None:
        return OfferResponse(grant=None, lease_seconds=pool.lease_seconds)
    logs.attach(**logs.grant_ids(got))
    child = tokens.child_token(key, got.row_id, got.fence) if key else None
    # The grant is a span of its run's trace (the row's), and its worker's parent.
    attributes = {"pool.row_id": got.row_id, "pool.attempt": got.attempt, "pool.fence": got.fence}
    with tracing.span("grant", got.traceparent, attributes, start=asked_at):
        got = replace(got, traceparent=tracing.current() or got.traceparent)
    return OfferResponse(grant=Grant.of(got, child_token=child), lease_seconds=pool.lease_seconds)


@router.post("/heartbeat", response_model=DeliveryResponse)
async def heartbeat(body: OwnEnvelope, pool: Pool, group: Heartbeats) -> DeliveryResponse:
    """Extend the lease of the exact attempt and fence the envelope names."""
    return DeliveryResponse(outcome=await group(body.checked(pool.pool_size)))


@router.post("/result", response_model=DeliveryResponse)
def result(
    body: Annotated[ResultEnvelope, Depends(_result)], pool: Pool, write: Write, events: PlaneEvents
) -> DeliveryResponse:
    """Deliver the run's result (``done``, or ``blocked`` with a reason); a replay is a duplicate."""
    outcome = write(pool.accept_result, body.checked(pool.pool_size))
    if outcome == "applied":
        events.scan_due("results")  # the board has it in milliseconds, not at the next tick
    return DeliveryResponse(outcome=outcome)


@router.post("/release", response_model=ReleaseResponse)
def release(body: OwnEnvelope, pool: Pool, write: Write, events: PlaneEvents) -> ReleaseResponse:
    """Hand the run back: re-offered at once (next attempt), or ``lease_failed`` at the last one."""
    outcome = write(pool.release, body.checked(pool.pool_size))
    if outcome == "reoffered":
        events.assigned([body.worker_ordinal])  # its next worker's waiting offer takes it at once
    elif outcome == "lease_failed":
        events.scan_due("materialize", force=True)  # its ordinal is free
    return ReleaseResponse(outcome=outcome)

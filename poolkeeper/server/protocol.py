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
from typing import Annotated, Any

from fastapi import APIRouter, Depends

from poolkeeper import tokens
from poolkeeper.server.deps import AuthFirst, Caller, Heartbeats, Pool, Secret, Write, worker_of
from poolkeeper.server.models import (
    DeliveryResponse,
    Envelope,
    ErrorBody,
    Grant,
    OfferRequest,
    OfferResponse,
    ReleaseResponse,
    ResultEnvelope,
)


def refusals(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The refusals a route declares in the schema, beside the 401, 413 and 422 every route may give."""
    return {code: {"model": ErrorBody} for code in (*codes, 401, 413, 422)}


WORKER_REFUSALS = refusals(403, 404, 408, 409, 503)
router = APIRouter(prefix="/v1", tags=["worker protocol"], responses=WORKER_REFUSALS, route_class=AuthFirst)


async def _asked(body: OfferRequest, who: Caller) -> OfferRequest:
    worker_of(body.ordinal, who)
    return body


async def _envelope(body: Envelope, who: Caller) -> Envelope:
    worker_of(body.worker_ordinal, who)
    return body


async def _result(body: ResultEnvelope, who: Caller) -> ResultEnvelope:
    worker_of(body.worker_ordinal, who)
    return body


OwnEnvelope = Annotated[Envelope, Depends(_envelope)]


@router.post("/offer", response_model=OfferResponse)
def offer(
    body: Annotated[OfferRequest, Depends(_asked)], pool: Pool, write: Write, key: Secret
) -> OfferResponse:
    """Take the ordinal's grant: its assigned run, under a new fence; ``grant: null`` when none."""
    got = write(pool.offer, body.ordinal, owner=body.owner)
    if got is None:
        return OfferResponse(grant=None, lease_seconds=pool.lease_seconds)
    child = tokens.child_token(key, got.row_id, got.fence) if key else None
    return OfferResponse(grant=Grant.of(got, child_token=child), lease_seconds=pool.lease_seconds)


@router.post("/heartbeat", response_model=DeliveryResponse)
async def heartbeat(body: OwnEnvelope, pool: Pool, group: Heartbeats) -> DeliveryResponse:
    """Extend the lease of the exact attempt and fence the envelope names."""
    return DeliveryResponse(outcome=await group(body.checked(pool.pool_size)))


@router.post("/result", response_model=DeliveryResponse)
def result(body: Annotated[ResultEnvelope, Depends(_result)], pool: Pool, write: Write) -> DeliveryResponse:
    """Deliver the run's result (``done``, or ``blocked`` with a reason); a replay is a duplicate."""
    return DeliveryResponse(outcome=write(pool.accept_result, body.checked(pool.pool_size)))


@router.post("/release", response_model=ReleaseResponse)
def release(body: OwnEnvelope, pool: Pool, write: Write) -> ReleaseResponse:
    """Hand the run back: re-offered at once (next attempt), or ``lease_failed`` at the last one."""
    return ReleaseResponse(outcome=write(pool.release, body.checked(pool.pool_size)))

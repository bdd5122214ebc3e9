"""The wire protocol's request and response bodies (docs/design.md, "Wire protocol").

Strict pydantic models: no coercion ("1" is not 1), no unknown fields, bounds
that keep every value inside what the store's columns hold. They give the
OpenAPI 3.1 schema and the 422s; the store still checks every envelope itself
(``store.Envelope.parse``), so the HTTP layer adds no rule of its own.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from store import Offer

INT32 = 2**31 - 1
INT64 = 2**63 - 1
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$"  # core.validate.NAME_RE
DIGEST_PATTERN = r"^[0-9a-f]{64}$"


def _name(max_length: int, description: str) -> Any:
    return Field(min_length=1, max_length=max_length, pattern=NAME_PATTERN, description=description)


Ordinal = Annotated[int, Field(ge=0, le=99_999, description="A worker slot, 0..POOL_SIZE-1.")]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class OfferRequest(Strict):
    ordinal: Ordinal
    owner: str = _name(128, "This worker instance; a new one per process start (a restart re-grants).")


class Envelope(Strict):
    """Names the exact holder: a heartbeat, a release, and (with ``payload``) a result."""

    delivery_id: str = _name(128, "Unique per delivery; a retry of the same delivery reuses it.")
    board: str = _name(64, "The grant's board.")
    task_id: str = _name(128, "The grant's task.")
    run_id: int = Field(ge=1, le=INT64)
    worker_ordinal: Ordinal
    attempt: int = Field(ge=1, le=INT32)
    fence: int = Field(ge=1, le=INT64)
    payload_digest: str = Field(pattern=DIGEST_PATTERN, description="The grant's payload_digest.")


class DoneResult(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    status: Literal["done"]


class BlockedResult(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    status: Literal["blocked"]
    reason: str = Field(max_length=4096, description="Why the run cannot finish; shown on the board.")


class ResultEnvelope(Envelope):
    payload: Annotated[DoneResult | BlockedResult, Field(discriminator="status")] = Field(
        description="The run's result: any JSON object with status done, or blocked with a reason."
        " At most 64 KiB; keys that look like credentials are refused."
    )


class Grant(BaseModel):
    """What ``offer`` hands the worker that holds an ordinal (docs/design.md, "Execution authority")."""

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
    protocol_version: int

    @classmethod
    def of(cls, offer: Offer) -> Grant:
        return cls(**{f.name: getattr(offer, f.name) for f in fields(offer)})


class OfferResponse(BaseModel):
    grant: Grant | None = Field(description="null: nothing to run on this ordinal now; poll again.")
    lease_seconds: float = Field(description="Lease length; heartbeat about every third of it.")


class DeliveryResponse(BaseModel):
    outcome: Literal["applied", "duplicate"]


class ReleaseResponse(BaseModel):
    outcome: Literal["reoffered", "lease_failed", "duplicate"]


class Issue(BaseModel):
    loc: list[str | int]
    msg: str
    type: str


class ErrorBody(BaseModel):
    error: str = Field(description="The error's class, e.g. StaleHolder, InvalidInput, TransientError.")
    detail: str | list[Issue]


class Health(BaseModel):
    status: Literal["ok", "ready"]


class Status(BaseModel):
    rows: dict[str, int]
    pool_size: int
    free_ordinals: list[int]
    quarantined: int

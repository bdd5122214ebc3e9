"""The wire protocol's request and response bodies (docs/design.md, "Wire protocol").

Strict pydantic models: no coercion ("1" is not 1), no unknown fields, bounds
that keep every value inside what the store's columns hold, taken from
``core.shapes`` and ``core.validate`` (never copied). They give the OpenAPI 3.1 schema
and the 422s. ``Grant`` is ``store.Offer``'s fields, derived from the dataclass,
plus the child token.
"""

from __future__ import annotations

import re
from dataclasses import fields, replace
from typing import Annotated, Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, create_model

from core import shapes, validate
from core.fields import Document, Text
from store import Envelope as StoreEnvelope
from store import Offer, lineage, models
from store.envelope import result_document


def _whole(pattern: re.Pattern[str]) -> str:
    """A pattern the store matches in full (``fullmatch``), anchored for JSON Schema."""
    return f"^{pattern.pattern}$"


NAME_PATTERN = _whole(validate.NAME_RE)
DOCUMENT_KIB = f"{validate.MAX_DOCUMENT_BYTES // 1024} KiB"
DIGEST_PATTERN = _whole(validate.DIGEST_RE)


def _name(max_length: int, description: str) -> Any:
    return Field(min_length=1, max_length=max_length, pattern=NAME_PATTERN, description=description)


Ordinal = Annotated[
    int, Field(ge=shapes.ORDINAL.low, le=shapes.ORDINAL.high, description="A worker slot, 0..POOL_SIZE-1.")
]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class OfferRequest(Strict):
    ordinal: Ordinal
    owner: str = _name(
        shapes.OWNER_CHARS, "This worker instance; a new one per process start (a restart re-grants)."
    )
    wait: float = Field(
        0.0,
        ge=0.0,
        le=validate.MAX_OFFER_WAIT_SECONDS,
        allow_inf_nan=False,
        description="Seconds to wait for a run when the ordinal has none (the server waits at most its"
        " POOL_OFFER_WAIT_SECONDS): answered as soon as one is assigned, else with grant null when they"
        " have passed or the server stops. 0: answer at once.",
    )


class Envelope(Strict):
    """Names the exact holder: a heartbeat, a release, and (with ``payload``) a result."""

    delivery_id: str = _name(
        shapes.DELIVERY_ID_CHARS, "Unique per delivery; a retry of the same delivery reuses it."
    )
    board: str = _name(shapes.BOARD_CHARS, "The grant's board.")
    task_id: str = _name(shapes.TASK_ID_CHARS, "The grant's task.")
    run_id: int = Field(ge=shapes.RUN_ID.low, le=shapes.RUN_ID.high)
    worker_ordinal: Ordinal
    attempt: int = Field(ge=shapes.ATTEMPT.low, le=shapes.ATTEMPT.high)
    fence: int = Field(ge=shapes.FENCE.low, le=shapes.FENCE.high)
    payload_digest: str = Field(pattern=DIGEST_PATTERN, description="The grant's payload_digest.")

    def checked(self, pool_size: int) -> StoreEnvelope:
        """The store's envelope, from the fields as validated here; the pool's size is the one bound
        a model cannot know (``tests/server/test_wire.py`` holds the two classes to the same fields)."""
        return StoreEnvelope(
            delivery_id=self.delivery_id,
            board=self.board,
            task_id=self.task_id,
            run_id=self.run_id,
            worker_ordinal=validate.ordinal("worker_ordinal", self.worker_ordinal, pool_size),
            attempt=self.attempt,
            fence=self.fence,
            payload_digest=self.payload_digest,
        )


class DoneResult(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    status: Literal["done"]


class BlockedResult(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    status: Literal["blocked"]
    reason: Text = Field(
        max_length=shapes.REASON_CHARS, description="Why the run cannot finish; shown on the board."
    )


class ResultEnvelope(Envelope):
    payload: Annotated[DoneResult | BlockedResult, Field(discriminator="status")] = Field(
        description="The run's result: any JSON object with status done, or blocked with a reason."
        f" At most {DOCUMENT_KIB}; keys that look like credentials are refused."
    )

    def checked(self, pool_size: int) -> StoreEnvelope:
        """The store's envelope with its result: the payload as validated here, then the store's
        own bounds on a document (size, depth, credential-like keys), which a model does not state."""
        return replace(super().checked(pool_size), result=result_document(self.payload.model_dump()))


# --- child executions (docs/design.md, "Lineage") ---------------------------------------------

CHILD_ID_PATTERN = _whole(lineage.CHILD_ID_RE)
CHILD_ID_CHARS = models.CHILD_ID_LENGTH


ChildId = Annotated[str, Field(max_length=CHILD_ID_CHARS, pattern=CHILD_ID_PATTERN)]
Key = Annotated[str, Field(min_length=1, max_length=shapes.KEY_CHARS, pattern=NAME_PATTERN)]
Epoch = Annotated[
    int,
    Field(
        ge=shapes.FENCE.low,
        le=shapes.FENCE.high,
        description="The epoch register returned (the grant's fence).",
    ),
]


class Holder(Strict):
    """The grant's holder, as ``offer`` named it: only its current grant registers children."""

    row_id: int = Field(ge=shapes.ROW_ID.low, le=shapes.ROW_ID.high)
    attempt: int = Field(ge=shapes.ATTEMPT.low, le=shapes.ATTEMPT.high)
    fence: int = Field(ge=shapes.FENCE.low, le=shapes.FENCE.high)
    owner: str = _name(shapes.OWNER_CHARS, "The worker instance the grant was offered to.")


class ChildRegistration(Holder):
    under: ChildId | None = Field(
        default=None, description="A live child of this grant to nest under (depth + 1); none: the run."
    )
    key: Key | None = Field(
        default=None,
        description="Makes registering idempotent: the same key under the same grant and parent"
        " returns the same child. Without one, every call registers a new child.",
    )


class VanishedChild(Holder):
    child_id: ChildId = Field(
        description="The live child whose worker vanished: it and its live descendants turn unknown."
    )


class ChildHeartbeat(Strict):
    child_id: ChildId = Field(description="The id register returned.")
    epoch: Epoch
    receipt: Document | None = Field(
        default=None,
        description=f"Optional JSON object replacing the child's last receipt (at most {DOCUMENT_KIB}).",
    )


class ChildResult(Strict):
    child_id: ChildId = Field(description="The id register returned.")
    epoch: Epoch
    payload: Document = Field(description=f"The child's result: a JSON object of at most {DOCUMENT_KIB}.")


class Child(BaseModel):
    """A registered child: ``child_id`` and ``epoch`` are what its process reports with."""

    child_id: str
    epoch: int
    row_id: int
    parent_id: str
    depth: int


class ChildHeartbeatResponse(BaseModel):
    outcome: Literal["applied"]


class VanishedResponse(BaseModel):
    unknown: int = Field(description="How many children (it and its live descendants) turned unknown.")


# The grant's fields are the store's ``Offer``, once: a field added there is on the wire and in the schema.
_OFFER: dict[str, Any] = {name: (hint, ...) for name, hint in get_type_hints(Offer).items()}
_OfferFields: Any = create_model("OfferFields", **_OFFER)


class Grant(_OfferFields):  # type: ignore[misc]
    """What ``offer`` hands the worker that holds an ordinal (docs/design.md, "Execution authority")."""

    child_token: str | None = Field(
        description="A bearer token for this grant's /v1/children calls only (its row and fence), for the"
        " command and its children instead of the ordinal's token; null on a --local-only server."
    )

    @classmethod
    def of(cls, offer: Offer, *, child_token: str | None) -> Grant:
        return cls(**{f.name: getattr(offer, f.name) for f in fields(offer)}, child_token=child_token)


class OfferResponse(BaseModel):
    grant: Grant | None = Field(description="null: nothing to run on this ordinal now; poll again.")
    lease_seconds: float = Field(description="Lease length; heartbeat about every third of it.")


class DeliveryResponse(BaseModel):
    outcome: Literal["applied", "duplicate"]


class ReleaseResponse(BaseModel):
    outcome: Literal["reoffered", "lease_failed", "duplicate"]


class Status(BaseModel):
    rows: dict[str, int]
    pool_size: int
    free_ordinals: list[int]
    quarantined: int
    ordinals_without_worker: list[int]  # no worker call for longer than a lease
    waiting_assigned: list[int]  # ids of rows ``assigned`` for longer than a lease
    worker_states: list[str]  # by ordinal: polling, busy or gone (``store.numbers.WorkerState``)
    dispatch_paused: bool  # an operator paused dispatch: no new claims (``poolctl resume``)
    paused_boards: list[str]  # boards paused on their own: no new claims from them (``resume --board``)

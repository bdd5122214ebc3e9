"""The envelope a pool worker sends with a heartbeat or a result, checked field by field."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core import shapes
from core.errors import InvalidInput
from core.validate import (
    canonical_json,
    digest_field,
    document,
    integer,
    label,
    name,
    ordinal,
    sha256,
    text,
)


@dataclass(frozen=True)
class Envelope:
    """What a pool worker sends with a heartbeat or a result (docs/design.md, "Worker protocol")."""

    delivery_id: str
    board: str
    task_id: str
    run_id: int
    worker_ordinal: int
    attempt: int
    fence: int
    payload_digest: str
    result: str | None = None  # canonical JSON of the result, for results only

    @classmethod
    def parse(cls, data: object, *, pool_size: int, with_result: bool) -> Envelope:
        if not isinstance(data, Mapping):
            raise InvalidInput("envelope", f"expected a JSON object, got {type(data).__name__}")
        required = [
            "delivery_id",
            "board",
            "task_id",
            "run_id",
            "worker_ordinal",
            "attempt",
            "fence",
            "payload_digest",
        ] + (["payload"] if with_result else [])
        for key in data:
            if not isinstance(key, str):
                raise InvalidInput("envelope", f"field names must be strings, got {type(key).__name__}")
        for key in required:
            if key not in data:
                raise InvalidInput(key, "missing")
        extra = set(data) - set(required)
        if extra:
            raise InvalidInput(label(min(extra)), "unknown field")
        result = result_document(data["payload"]) if with_result else None  # checked first, as ever
        return cls(
            delivery_id=name("delivery_id", data["delivery_id"], shapes.DELIVERY_ID_CHARS),
            board=name("board", data["board"], shapes.BOARD_CHARS),
            task_id=name("task_id", data["task_id"], shapes.TASK_ID_CHARS),
            run_id=integer("run_id", data["run_id"], *shapes.RUN_ID),
            worker_ordinal=ordinal("worker_ordinal", data["worker_ordinal"], pool_size),
            attempt=integer("attempt", data["attempt"], *shapes.ATTEMPT),
            fence=integer("fence", data["fence"], *shapes.FENCE),
            payload_digest=digest_field("payload_digest", data["payload_digest"]),
            result=result,
        )

    def digest(self) -> str:
        """What makes a replay "the same delivery": everything but the delivery id."""
        return sha256(
            canonical_json(
                [
                    self.board,
                    self.task_id,
                    self.run_id,
                    self.worker_ordinal,
                    self.attempt,
                    self.fence,
                    self.payload_digest,
                    self.result,
                ]
            )
        )


def result_document(payload: object) -> str:
    """A result's payload as the store keeps it (canonical JSON), once it is checked: a JSON object
    within ``document``'s bounds, ``done``, or ``blocked`` with a storable reason."""
    result = document("payload", payload)
    _check_result_shape(payload)  # type: ignore[arg-type]  # document() refused anything but an object
    return result


def _check_result_shape(payload: Mapping[str, Any]) -> None:
    status = payload.get("status")
    if status not in ("done", "blocked"):
        raise InvalidInput("payload.status", f"must be 'done' or 'blocked', got {status!r}")
    if status == "blocked":
        if not isinstance(payload.get("reason"), str):
            raise InvalidInput("payload.reason", "a blocked result needs a reason (string)")
        text("payload.reason", payload["reason"])  # it goes to the board and the audit trail

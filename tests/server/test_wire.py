"""One wire vocabulary: the grant and the envelope are the store's types, on the server and in the client."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from typing import Any, get_type_hints

import pytest

from board.protocol import SEARCH_MAX_CHARS
from core import shapes, validate
from core.errors import InvalidInput
from core.settings import Settings
from poolkeeper.api import models
from poolkeeper.api.app import create_app
from poolkeeper.boardserver import app as board_api
from poolkeeper.workerhost import client
from store import Envelope, Offer, lineage
from store import models as store_models


def hints(cls: type) -> dict[str, Any]:
    return dict(get_type_hints(cls))


def test_the_servers_grant_is_the_stores_offer_plus_the_child_token() -> None:
    fields = {name: f.annotation for name, f in models.Grant.model_fields.items()}
    assert fields == {**hints(Offer), "child_token": str | None}
    assert list(fields) == [f.name for f in dataclasses.fields(Offer)] + ["child_token"]


def test_the_clients_grant_is_the_stores_offer_field_by_field() -> None:
    assert issubclass(client.Grant, Offer), "derived, not copied"
    theirs = hints(client.Grant)
    assert {k: v for k, v in theirs.items() if k not in ("lease_seconds", "child_token")} == hints(Offer)
    assert theirs["child_token"] == str | None and theirs["lease_seconds"] is float


def test_the_servers_envelope_is_the_stores_field_by_field() -> None:
    store = {f.name for f in dataclasses.fields(Envelope)} - {"result"}  # a result's payload, canonical
    assert set(models.Envelope.model_fields) == store
    assert set(models.ResultEnvelope.model_fields) == store | {"payload"}


def test_the_models_patterns_are_core_validates() -> None:
    schema = models.Envelope.model_json_schema()["properties"]
    assert schema["board"]["pattern"] == f"^{validate.NAME_RE.pattern}$"
    assert schema["payload_digest"]["pattern"] == f"^{validate.DIGEST_RE.pattern}$"
    child = models.ChildHeartbeat.model_json_schema()["properties"]["child_id"]
    assert re.fullmatch(child["pattern"].strip("^$"), "run:7/child:0123456789ab")
    assert child["pattern"] == f"^{lineage.CHILD_ID_RE.pattern}$"


# Each bounded field of both APIs, by name, and the declaration it must take its bound from.
LENGTHS = {
    "board": shapes.BOARD_CHARS,
    "task_id": shapes.TASK_ID_CHARS,
    "delivery_id": shapes.DELIVERY_ID_CHARS,
    "owner": shapes.OWNER_CHARS,
    "key": shapes.KEY_CHARS,
    "request_id": shapes.REQUEST_ID_CHARS,
    "assignee": shapes.ASSIGNEE_CHARS,
    "lane": shapes.LANE_CHARS,
    "kind": shapes.BLOCK_KIND_CHARS,
    "reason": shapes.REASON_CHARS,
    "child_id": store_models.CHILD_ID_LENGTH,
    "under": store_models.CHILD_ID_LENGTH,
    "task_ids": shapes.TASK_ID_CHARS,  # each of a list's
    "skip_boards": shapes.BOARD_CHARS,  # each of a list's (the list itself: at most shapes.SKIP_BOARDS)
    "name": shapes.BOARD_CHARS,  # the board API's paths name a board so
    "title": validate.MAX_DOCUMENT_BYTES,  # a task's title and body: the run's payload bounds them together
    "body": validate.MAX_DOCUMENT_BYTES,
    "q": SEARCH_MAX_CHARS,  # a search's text
}
RANGES = {
    "row_id": shapes.ROW_ID,
    "run_id": shapes.RUN_ID,
    "expected_run_id": shapes.RUN_ID,
    "attempt": shapes.ATTEMPT,
    "fence": shapes.FENCE,
    "epoch": shapes.FENCE,
    "ordinal": shapes.ORDINAL,
    "worker_ordinal": shapes.ORDINAL,
    "limit": None,  # how many to list or claim: a request's size, not a value that is stored
    "wait": None,  # how long an offer may wait: a request's patience, not a value that is stored
}


def bounds_in(schema: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(schema, dict):
        for key, value in schema.items():
            if key in ("maxLength", "minimum", "maximum"):
                yield key, value
            else:
                yield from bounds_in(value)
    elif isinstance(schema, list):
        for value in schema:
            yield from bounds_in(value)


def bounded_fields(api: dict[str, Any]) -> Iterator[tuple[str, str, Any]]:
    """(field, "maxLength"/"minimum"/"maximum", bound) of every body property and query parameter."""
    for body in api["components"]["schemas"].values():
        for name, prop in body.get("properties", {}).items():
            yield from ((name, *bound) for bound in bounds_in(prop))
    for path in api["paths"].values():
        for op in path.values():
            for param in op.get("parameters", []):
                yield from ((param["name"], *bound) for bound in bounds_in(param["schema"]))


def protocol_schema() -> dict[str, Any]:
    return create_app(Settings(), local_only=True).openapi()


APIS: dict[str, tuple[Callable[[], dict[str, Any]], set[str]]] = {  # each with fields it must show
    "protocol": (protocol_schema, {"board", "owner", "fence", "ordinal"}),
    "board": (board_api.openapi, {"board", "expected_run_id", "assignee"}),
}


@pytest.mark.parametrize("which", list(APIS))
def test_every_bound_on_the_wire_is_the_one_core_shapes_declares(which: str) -> None:
    schema, some = APIS[which]
    seen = set()
    for name, key, bound in bounded_fields(schema()):
        seen.add(name)
        if key == "maxLength":
            assert bound == LENGTHS[name], f"{which}: {name}'s length"
        elif (shape := RANGES[name]) is not None:
            expected = shape.low if key == "minimum" else shape.high
            assert float(bound) == float(expected), f"{which}: {name}'s {key}"  # 2**63-1: a float there
    assert seen >= some


HOLDER: dict[str, Any] = {
    "delivery_id": "d1",
    "board": "b",
    "task_id": "t",
    "run_id": 1,
    "worker_ordinal": 2,
    "attempt": 1,
    "fence": 9,
    "payload_digest": "0" * 64,
}


def test_a_checked_envelope_reaches_the_store_as_validated() -> None:
    body = dict(HOLDER)
    assert models.Envelope.model_validate(body).checked(pool_size=3) == Envelope.parse(
        body, pool_size=3, with_result=False
    )


@pytest.mark.parametrize(
    "payload",
    [{"status": "done", "out": {"n": [1, 2.5, None]}}, {"status": "blocked", "reason": "no disk"}],
)
def test_a_checked_result_envelope_is_the_one_the_store_would_parse(payload: dict[str, Any]) -> None:
    body = {**HOLDER, "payload": payload}
    checked = models.ResultEnvelope.model_validate(body).checked(pool_size=3)
    assert checked == Envelope.parse(body, pool_size=3, with_result=True)
    assert (
        checked.result is not None
        and checked.digest() == Envelope.parse(body, pool_size=3, with_result=True).digest()
    )


def test_a_checked_result_still_meets_the_stores_rule_for_a_document() -> None:
    """What the model does not state (credential-like keys, size) the store's rule still refuses."""
    body = {**HOLDER, "payload": {"status": "done", "api_key": "x"}}
    with pytest.raises(InvalidInput, match="payload"):
        models.ResultEnvelope.model_validate(body).checked(pool_size=3)

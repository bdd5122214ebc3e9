"""One wire vocabulary: the grant and the envelope are the store's types, on the server and in the client."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, get_type_hints

import pytest

from core import validate
from core.errors import InvalidInput
from poolkeeper import client
from poolkeeper.server import models
from store import Envelope, Offer, lineage


def hints(cls: type) -> dict[str, Any]:
    return dict(get_type_hints(cls))


def test_the_servers_grant_is_the_stores_offer_plus_the_child_token() -> None:
    fields = {name: f.annotation for name, f in models.Grant.model_fields.items()}
    assert fields == {**hints(Offer), "child_token": str | None}
    assert list(fields) == [f.name for f in dataclasses.fields(Offer)] + ["child_token"]


def test_the_clients_grant_is_the_stores_offer_field_by_field() -> None:
    theirs = hints(client.Grant)
    assert {k: v for k, v in theirs.items() if k not in ("lease_seconds", "child_token")} == hints(Offer)
    assert theirs["child_token"] == str | None and theirs["lease_seconds"] is float


def test_the_servers_envelope_is_the_stores_field_by_field() -> None:
    store = {f.name for f in dataclasses.fields(Envelope)} - {"result"}  # a result's payload, canonical
    assert set(models.Envelope.model_fields) == store
    assert set(models.ResultEnvelope.model_fields) == store | {"payload"}


def test_the_models_bounds_are_core_validates() -> None:
    schema = models.Envelope.model_json_schema()["properties"]
    assert schema["board"]["pattern"] == f"^{validate.NAME_RE.pattern}$"
    assert schema["payload_digest"]["pattern"] == f"^{validate.DIGEST_RE.pattern}$"
    assert schema["attempt"]["maximum"] == validate.INT32_MAX
    assert schema["fence"]["maximum"] == schema["run_id"]["maximum"] == validate.INT64_MAX
    assert schema["worker_ordinal"]["maximum"] == validate.MAX_POOL_SIZE - 1
    child = models.ChildHeartbeat.model_json_schema()["properties"]["child_id"]
    assert re.fullmatch(child["pattern"].strip("^$"), "run:7/child:0123456789ab")
    assert child["pattern"] == f"^{lineage.CHILD_ID_RE.pattern}$"


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

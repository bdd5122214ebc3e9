"""Bad envelopes are refused with an error naming the field, and nothing is written."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from sqlalchemy import text

from core.errors import InvalidInput, NotFound, PoolError, StaleHolder
from core.validate import INT32_MAX, INT64_MAX, MAX_DEPTH
from store import PoolStore
from tests.factories import NOW, OWNER, envelope, given_running

CASES: list[Any] = [
    ("delivery_id", None, "delivery_id"),  # missing (None = drop the key)
    ("board", None, "board"),
    ("fence", None, "fence"),
    ("run_id", "1", "run_id: expected an integer"),
    ("attempt", True, "attempt: expected an integer"),
    ("fence", 2.5, "fence: expected an integer"),
    ("worker_ordinal", -1, "worker_ordinal: must be between 0 and 2"),
    ("worker_ordinal", 3, "worker_ordinal: must be between 0 and 2"),
    ("run_id", 0, "run_id: must be between 1 and"),
    ("run_id", 2**63, "run_id: must be between 1 and 9223372036854775807"),
    ("fence", 2**63, "fence: must be between 1 and 9223372036854775807"),
    ("attempt", 2**31, "attempt: must be between 1 and 2147483647"),
    pytest.param(
        "fence",
        10**5000,
        "fence: must be between 1 and 9223372036854775807, got an integer of",
        id="fence-10**5000",
    ),
    ("fence", True, "fence: expected an integer"),
    ("delivery_id", "x" * 129, "delivery_id: must be 1 to 128"),
    ("task_id", "", "task_id: must be 1 to 128"),
    ("board", "b'; DROP TABLE assignments; --", "board: may hold only"),
    ("task_id", "t1 OR 1=1", "task_id: may hold only"),
    ("payload_digest", "abc", "payload_digest: expected a lowercase hex SHA-256"),
    ("surprise", 1, "surprise: unknown field"),
]


def _snapshot(store: PoolStore) -> list[Any]:
    with store.session(readonly=True) as s:
        return [
            list(s.execute(text(f"SELECT * FROM {t} ORDER BY 1")))
            for t in ("assignments", "deliveries", "fence_sequence")
        ]


@pytest.mark.parametrize(("field", "value", "message"), CASES)
@pytest.mark.parametrize("kind", ["heartbeat", "result", "release"])
def test_bad_envelope_is_refused_naming_the_field(
    store: PoolStore, kind: str, field: str, value: Any, message: str
) -> None:
    offer = given_running(store)
    env = envelope(offer, payload={"status": "done"}) if kind == "result" else envelope(offer)
    if value is None:
        del env[field]
    else:
        env[field] = value
    before = _snapshot(store)
    call = {"heartbeat": store.heartbeat, "result": store.accept_result, "release": store.release}[kind]
    with pytest.raises(InvalidInput) as refused:
        call(env, now=NOW)
    assert message in str(refused.value)
    assert _snapshot(store) == before


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"status": "finished"}, "payload.status"),
        ({"status": "blocked"}, "payload.reason"),
        ({"status": "blocked", "reason": "nul \x00 here"}, "payload.reason: must not contain a NUL"),
        ({"status": "blocked", "reason": "lone \ud800"}, "payload.reason: holds a lone surrogate"),
        ("done", "payload: expected a JSON object"),
        ({"status": "done", "auth": {"api_key": "k"}}, "payload.auth"),
        ({"status": "done", "blob": "x" * 70_000}, "payload: larger than"),
        ({"status": "done", "n": float("nan")}, "payload.n: not JSON"),
    ],
)
def test_bad_result_payload_is_refused(store: PoolStore, payload: Any, message: str) -> None:
    offer = given_running(store)
    before = _snapshot(store)
    with pytest.raises(InvalidInput, match=message.replace(".", r"\.")):
        store.accept_result(envelope(offer, payload=payload), now=NOW)
    assert _snapshot(store) == before


@pytest.mark.parametrize(
    ("owner", "message"),
    [
        ("", "owner: must be 1 to 128"),
        ("w" * 129, "owner: must be 1 to 128"),
        ("w 1", "owner: may hold only"),
        (7, "owner: expected a string"),
    ],
)
def test_bad_owner_is_refused_and_nothing_is_granted(store: PoolStore, owner: Any, message: str) -> None:
    store.add_run(board="b", task_id="t1", run_id=1, ordinal=0, payload={}, now=NOW)
    before = _snapshot(store)
    with pytest.raises(InvalidInput, match=message):
        store.offer(0, owner=owner, now=NOW)
    assert _snapshot(store) == before


def test_unknown_board_and_unknown_run_are_named(store: PoolStore) -> None:
    offer = given_running(store)
    before = _snapshot(store)
    with pytest.raises(NotFound, match="board: unknown board 'elsewhere'"):
        store.heartbeat(envelope(offer, board="elsewhere"), now=NOW)
    with pytest.raises(NotFound, match="task_id/run_id"):
        store.heartbeat(envelope(offer, run_id=7), now=NOW)
    assert _snapshot(store) == before


def test_envelope_that_is_not_an_object_is_refused(store: PoolStore) -> None:
    with pytest.raises(InvalidInput, match="envelope: expected a JSON object"):
        store.heartbeat(["not", "a", "dict"], now=NOW)  # type: ignore[arg-type]
    assert issubclass(InvalidInput, PoolError)


# One unit on either side of each column's range: the last value in range reaches the
# database (and is refused there only as a stale holder); the first one past it is refused
# by validation. Integer columns are 32-bit, BigInteger columns 64-bit.
COLUMN_LIMITS = [("run_id", INT64_MAX), ("attempt", INT32_MAX), ("fence", INT64_MAX)]


@pytest.mark.parametrize(("field", "limit"), COLUMN_LIMITS)
def test_integers_are_bounded_by_their_column(store: PoolStore, field: str, limit: int) -> None:
    offer = given_running(store)
    before = _snapshot(store)
    at_limit: dict[str, Any] = {field: limit}
    past_limit: dict[str, Any] = {field: limit + 1}
    with pytest.raises((StaleHolder, NotFound)):
        store.heartbeat(envelope(offer, **at_limit), now=NOW)
    with pytest.raises(InvalidInput, match=f"{field}: must be between 1 and {limit}"):
        store.heartbeat(envelope(offer, **past_limit), now=NOW)
    assert _snapshot(store) == before


def test_add_run_bounds_the_run_id_by_its_column(store: PoolStore) -> None:
    assert store.add_run(board="b", task_id="t", run_id=INT64_MAX, ordinal=0, payload={}, now=NOW) == "added"
    before = _snapshot(store)
    for bad in (INT64_MAX + 1, True):
        with pytest.raises(InvalidInput, match="run_id"):
            store.add_run(board="b", task_id="u", run_id=bad, ordinal=1, payload={}, now=NOW)
    assert _snapshot(store) == before


@pytest.mark.parametrize("ordinal", [3, 2**31, 2**63, -1, True, "0"])
def test_offer_refuses_an_ordinal_outside_the_pool(store: PoolStore, ordinal: Any) -> None:
    given_running(store)
    before = _snapshot(store)
    with pytest.raises(InvalidInput, match="ordinal"):
        store.offer(ordinal, owner=OWNER, now=NOW)
    assert _snapshot(store) == before


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({1: "x", "zz": "y"}, "envelope: field names must be strings, got int"),
        ({None: 1}, "envelope: field names must be strings, got NoneType"),
        ({"zz": 1, "aa": 2}, "aa: unknown field"),
        ({"\ud800" * 100: 1}, "'\\ud800"),
    ],
)
def test_unknown_fields_of_any_type_are_refused_by_name(
    store: PoolStore, extra: dict[Any, Any], message: str
) -> None:
    offer = given_running(store)
    before = _snapshot(store)
    with pytest.raises(InvalidInput) as refused:
        store.heartbeat({**envelope(offer), **extra}, now=NOW)
    assert message in str(refused.value)
    assert _snapshot(store) == before


def _nested(depth: int) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    inner = doc
    for _ in range(depth - 1):
        inner["a"] = {}
        inner = inner["a"]
    return doc


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"deep": _nested(MAX_DEPTH)}, r"payload\.deep(\.a)+: nested deeper than 64 levels"),
        ({"deep": _nested(sys.getrecursionlimit() * 5)}, "nested deeper than 64 levels"),
        ({"list": [[[]] * 2] * 2, "deep": [_nested(100)]}, r"payload\.deep\[0\](\.a)+: nested deeper"),
        ({"n": {1: "x"}}, "payload.n: object keys must be strings, got int"),
        ({"n": {"a": 1, 2: "b"}}, "payload.n: object keys must be strings, got int"),
        ({"s": "ok \ud800"}, "payload.s: holds a lone surrogate"),
        ({"s": "a\x00b"}, "payload.s: must not contain a NUL character"),
        ({"in": {"k\x00": 1}}, "payload.in.*: key must not contain a NUL character"),
        ({"n": 2**63}, "payload.n: integers must fit in 64 bits"),
        ({"n": 10**5000}, "payload.n: integers must fit in 64 bits"),
        ({"b": b"bytes"}, "payload.b: not a JSON value: bytes"),
        ({"huge": ["x"] * 1_000_000}, "payload: larger than"),
    ],
)
def test_result_payloads_are_walked_without_recursion(
    store: PoolStore, extra: dict[str, Any], message: str
) -> None:
    offer = given_running(store)
    before = _snapshot(store)
    with pytest.raises(InvalidInput, match=message):
        store.accept_result(envelope(offer, payload={"status": "done", **extra}), now=NOW)
    assert _snapshot(store) == before


def test_a_document_at_the_depth_limit_is_accepted(store: PoolStore) -> None:
    offer = given_running(store)
    payload = {"status": "done", "deep": _nested(MAX_DEPTH - 1)}  # the payload itself is level 1
    assert store.accept_result(envelope(offer, payload=payload), now=NOW) == "applied"

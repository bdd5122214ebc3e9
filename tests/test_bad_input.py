"""Bad envelopes are refused with an error naming the field, and nothing is written."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import text

from core.errors import InvalidInput, NotFound, PoolError
from store import PoolStore
from tests.factories import NOW, envelope, given_running

CASES: list[tuple[str, Any, str]] = [
    ("delivery_id", None, "delivery_id"),  # missing (None = drop the key)
    ("board", None, "board"),
    ("fence", None, "fence"),
    ("run_id", "1", "run_id: expected an integer"),
    ("attempt", True, "attempt: expected an integer"),
    ("fence", 2.5, "fence: expected an integer"),
    ("worker_ordinal", -1, "worker_ordinal: must be between 0 and 2"),
    ("worker_ordinal", 3, "worker_ordinal: must be between 0 and 2"),
    ("run_id", 0, "run_id: must be >= 1"),
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
        ("done", "payload: expected a JSON object"),
        ({"status": "done", "auth": {"api_key": "k"}}, "payload.auth"),
        ({"status": "done", "blob": "x" * 70_000}, "payload: larger than"),
        ({"status": "done", "n": float("nan")}, "payload: not JSON"),
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

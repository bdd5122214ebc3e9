"""Fuzzing the store's worker-facing entry points and the document check with generated garbage.

Given a store with a live ``running`` row (and an ``assigned`` one), thousands of
generated heartbeat and result envelopes, plus ``offer`` and ``add_run`` calls,
are sent: wrong types, ints past every column, bools, deep nesting, unknown keys
of mixed types, non-string keys, lone surrogates, enormous strings. Every
refusal must be a ``PoolError`` and leave every table exactly as it was; the
rare call that is valid is accepted, and the store is put back for the next.

Each example sends ten envelopes and up to two other calls. ``POOL_FUZZ_EXAMPLES``
scales the SQLite run (default 1000 examples: 10,000 envelopes); PostgreSQL gets a
fifth of it. The document check is fuzzed alone at the end.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
from hypothesis import HealthCheck, given
from hypothesis import strategies as st
from sqlalchemy import delete, insert, select

from core import validate
from core.errors import InvalidInput, PoolError
from store import Offer, PoolStore
from store.models import metadata
from tests import properties
from tests.factories import NOW, OWNER, envelope, given_running

EXAMPLES = int(os.environ.get("POOL_FUZZ_EXAMPLES", "1000"))
ENVELOPES_AT_LEAST = 10_000
FIELDS = ["delivery_id", "board", "task_id", "run_id", "worker_ordinal", "attempt", "fence", "payload_digest"]
SURROGATES = st.sampled_from(["\ud800", "\udbff", "\udc00", "\udfff", "a\ud83d", "\ude00b"])

# --- generated values ----------------------------------------------------------

edge_ints = st.sampled_from(
    [0, 1, -1, 2, 3, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63), -(2**63) - 1]
)


def _too_long_to_print() -> int:
    return 10**5000  # past Python's int-to-text limit: a naive error message would raise


ints = st.one_of(edge_ints, st.integers(), st.integers(-(2**80), 2**80), st.builds(_too_long_to_print))
texts = st.one_of(
    st.text(max_size=12),
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,20}", fullmatch=True),
    st.tuples(st.text(max_size=4), SURROGATES).map("".join),
    st.integers(129, 300_000).map(lambda n: "x" * n),  # past every name limit, past the document limit
    st.sampled_from(["auth", "api_key", "Password", "b'; DROP TABLE assignments; --", "t\x00", "\u0000"]),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
    st.binary(max_size=8),
)
keys = st.one_of(texts, ints, st.none(), st.booleans(), st.floats(allow_nan=False), st.tuples(st.integers()))


def nested(depth: int, kind: str, leaf: Any = 1) -> Any:
    """``depth`` containers, one inside the other, around ``leaf``, built without recursion."""
    value: Any = leaf
    for i in range(depth):
        value = [value] if kind == "list" or (kind == "mixed" and i % 2) else {"k": value}
    return value


# around the limit of 64, and past the interpreter's recursion limit (1000)
deep = st.builds(
    nested,
    st.one_of(st.integers(60, 70), st.sampled_from([1001, 1500])),
    st.sampled_from(["list", "dict", "mixed"]),
)
json_values = st.recursive(
    scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.dictionaries(keys, children, max_size=3),
        st.dictionaries(st.text(max_size=6), children, max_size=3),
    ),
    max_leaves=6,
)
anything = st.one_of(json_values, deep, st.sets(st.integers(), max_size=2), st.just(object()))


# Built once: a strategy made inside a draw is rebuilt and validated on every call.
one_in_ten, one_in_fifty = st.integers(0, 9), st.integers(0, 49)
statuses = st.sampled_from(["done", "done", "blocked", "finished", 1])
extra_count = st.integers(0, 2)
delivery_ids = st.sampled_from(["d1", "d2", "d3"])  # few, so replays and conflicts happen
breakages = st.sampled_from([0] + [1] * 6 + [2] * 4 + [3] * 2)  # mostly broken, sometimes valid
envelope_fields = st.sampled_from(FIELDS)
result_fields = st.sampled_from([*FIELDS, "payload"])
hows = st.sampled_from(["replace", "edge_int", "near", "drop", "unknown", "unknown"])
edge_or_bool = edge_ints | st.booleans()
nudges = st.sampled_from([-1, 1, 2**31, 2**62])  # in range, but not the holder's value


@st.composite
def a_payload(draw: st.DrawFn) -> Any:
    """A result payload: mostly a result object with something odd in it, sometimes anything."""
    if draw(one_in_ten) == 0:
        return draw(anything)
    payload: dict[Any, Any] = {"status": draw(statuses)}
    if payload["status"] == "blocked" and draw(st.booleans()):
        payload["reason"] = draw(texts)
    for _ in range(draw(extra_count)):
        payload[draw(keys)] = draw(anything)
    return payload


payloads = a_payload()


@st.composite
def an_envelope(draw: st.DrawFn, holder: Offer, with_result: bool) -> Any:
    """The holder's envelope with a few fields broken; occasionally none (a valid delivery)."""
    if draw(one_in_fifty) == 0:
        return draw(anything)  # not even an object
    env: dict[Any, Any] = envelope(holder, delivery_id=draw(delivery_ids))
    if with_result:
        env["payload"] = draw(payloads)
    for _ in range(draw(breakages)):
        field = draw(result_fields if with_result else envelope_fields)
        how = draw(hows)
        if how == "replace":
            env[field] = draw(anything)
        elif how == "edge_int":
            env[field] = draw(edge_or_bool)
        elif how == "near" and isinstance(env.get(field), int):
            env[field] = env[field] + draw(nudges)
        elif how == "drop":
            env.pop(field, None)
        else:
            env[draw(keys)] = draw(anything)
    return env


# --- the store under fire --------------------------------------------------------


def dump(store: PoolStore) -> list[tuple[str, list[tuple[Any, ...]]]]:
    """Every table of the store, every row, in a fixed order."""
    with store.engine.connect() as conn:
        return [(t.name, sorted(tuple(r) for r in conn.execute(select(t)))) for t in metadata.sorted_tables]


def restore(store: PoolStore, tables: list[tuple[str, list[tuple[Any, ...]]]]) -> None:
    """Put every table back as it was (after a call that was valid and changed something)."""
    by_name = {t.name: t for t in metadata.sorted_tables}
    with store.session() as s:
        for name, rows in tables:
            table = by_name[name]
            s.execute(delete(table))
            if rows:
                s.execute(insert(table), [dict(zip(table.columns.keys(), r, strict=True)) for r in rows])


class Fuzzer:
    """Sends one call at a time; a refusal or a duplicate must leave every table as it was."""

    def __init__(self, store: PoolStore) -> None:
        self.store = store
        self.holder = given_running(store, 0, "t1")
        store.add_run(board="b", task_id="t2", run_id=1, ordinal=1, payload={"title": "t2"}, now=NOW)
        self.initial = self.expected = dump(store)
        self.seen: Counter[str] = Counter()

    def send(self, kind: str, call: Callable[..., object], *args: Any, **kwargs: Any) -> None:
        try:
            answer = call(*args, now=NOW, **kwargs)
        except PoolError as err:
            self.seen[f"{kind} refused: {type(err).__name__}"] += 1
            assert dump(self.store) == self.expected, f"{kind} refused ({err}) yet changed the store"
            return
        self.seen[f"{kind} answered: {answer if isinstance(answer, str) else type(answer).__name__}"] += 1
        after = dump(self.store)
        if answer == "duplicate":
            assert after == self.expected, f"{kind} answered duplicate yet changed the store"
        elif kind == "heartbeat":
            self.expected = after  # its delivery record stays: a replay is a duplicate, or a conflict
        elif after != self.initial:  # a result, grant or new row: back to one live running row
            restore(self.store, self.initial)
            self.expected = self.initial


ENVELOPES_PER_EXAMPLE = 10


kinds = st.lists(
    st.sampled_from(["heartbeat", "result"]), min_size=ENVELOPES_PER_EXAMPLE, max_size=ENVELOPES_PER_EXAMPLE
)
others = st.lists(st.sampled_from(["offer", "add_run"]), max_size=2)
ordinals = st.one_of(st.integers(-1, 3), ints, scalars)
VALID_ADD = {"board": "b", "task_id": "t9", "run_id": 1, "ordinal": 2, "payload": {"title": "t9"}}
add_args = st.fixed_dictionaries(
    {k: st.one_of(st.just(v), anything, edge_ints) for k, v in VALID_ADD.items()}
)


@st.composite
def an_example(draw: st.DrawFn, holder: Offer) -> list[tuple[str, Any]]:
    """Ten envelopes, heartbeats and results, then up to two ``offer``/``add_run`` calls."""
    heartbeats, results = an_envelope(holder, with_result=False), an_envelope(holder, with_result=True)
    actions = [(kind, draw(results if kind == "result" else heartbeats)) for kind in draw(kinds)]
    actions += [(kind, draw(ordinals if kind == "offer" else add_args)) for kind in draw(others)]
    return actions


def fuzz(store: PoolStore, examples: int) -> Counter[str]:
    """``examples`` under the ``ci`` profile (``properties.examples`` says how many run)."""
    fuzzer = Fuzzer(store)
    # The holder's own owner: asking again for its grant changes nothing (a new owner re-grants).
    offer = partial(store.offer, owner=OWNER)
    calls: dict[str, Callable[..., object]] = {
        "heartbeat": store.heartbeat,
        "result": store.accept_result,
        "offer": offer,
    }

    too_large = (HealthCheck.data_too_large, HealthCheck.large_base_example)

    @properties.budget(examples, database=None, suppress=too_large)
    @given(an_example(fuzzer.holder))
    def run(actions: list[tuple[str, Any]]) -> None:
        for kind, arg in actions:
            if kind == "add_run":
                fuzzer.send(kind, store.add_run, **arg)
            else:
                fuzzer.send(kind, calls[kind], arg)

    run()
    return fuzzer.seen


@pytest.mark.property
def test_generated_envelopes_are_refused_cleanly_and_change_nothing(
    store: PoolStore, backend_url: str
) -> None:
    budget = EXAMPLES if backend_url.startswith("sqlite") else max(EXAMPLES // 5, 50)
    seen, examples = fuzz(store, budget), properties.examples(budget)
    envelopes = sum(n for k, n in seen.items() if k.startswith(("heartbeat", "result")))
    assert envelopes == examples * ENVELOPES_PER_EXAMPLE, seen
    if examples >= 1000:
        assert envelopes >= ENVELOPES_AT_LEAST
    # The generator reaches the kinds of answer that matter, so the checks were not vacuous:
    # refusals by validation, and envelopes that got as far as the database.
    reached = [
        "heartbeat refused: InvalidInput",
        "result refused: InvalidInput",
        "offer refused: InvalidInput",
    ]
    if examples >= 1000:
        reached += [
            "heartbeat refused: StaleHolder",
            "heartbeat answered: applied",
            "heartbeat answered: duplicate",
            "result answered: applied",
            "add_run refused: InvalidInput",
        ]
    for answer in reached:
        assert seen[answer] > 0, (answer, seen)
    # (a reused delivery id is a DeliveryConflict only for the current holder; from anyone
    # else it is StaleHolder, checked first: docs/design.md, "check before replay")
    in_the_database = ("StaleHolder", "NotFound", "DeliveryConflict", "applied", "duplicate")
    assert sum(n for k, n in seen.items() if k.endswith(in_the_database)) > 0, seen


# --- the document check alone ----------------------------------------------------


def _depth(value: Any) -> int:
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list | tuple):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


@properties.budget(2000, database=None)
@given(st.one_of(anything, st.dictionaries(keys, anything, max_size=6)))
def test_document_accepts_only_json_it_can_canonicalise_and_refuses_the_rest_cleanly(value: Any) -> None:
    try:
        text = validate.document("payload", value)
    except InvalidInput as err:
        assert err.field.startswith("payload") and len(str(err)) < 1000
        return
    assert len(text.encode()) <= validate.MAX_DOCUMENT_BYTES
    decoded = json.loads(text)
    assert validate.canonical_json(decoded) == text
    assert _depth(decoded) <= validate.MAX_DEPTH
    text.encode("utf-8")  # no lone surrogate survived


storable = st.characters(exclude_categories=["Cs"], exclude_characters="\x00")  # what a document holds
plain_keys = st.text(storable, max_size=8).filter(lambda k: not validate.SECRET_KEY_RE.search(k))
clean_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-(2**63), 2**63 - 1),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(storable, max_size=10),
    ),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(plain_keys, children, max_size=4),
    max_leaves=12,
)


@properties.budget(400, database=None)
@given(st.dictionaries(plain_keys, clean_json, max_size=4), st.integers(0, 70))
def test_document_accepts_every_clean_object_up_to_the_depth_limit(doc: dict[str, Any], wrap: int) -> None:
    value = {"v": nested(wrap, "mixed", leaf=doc)}
    depth = _depth(value)
    if depth > validate.MAX_DEPTH:
        with pytest.raises(InvalidInput, match=re.escape(f"nested deeper than {validate.MAX_DEPTH} levels")):
            validate.document("payload", value)
        return
    assert json.loads(validate.document("payload", value)) == value

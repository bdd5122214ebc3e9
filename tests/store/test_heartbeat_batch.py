"""A group commit's heartbeats in one statement (``worker.new_heartbeats``), each answered alone.

The batch's common case is one set statement guarded like ``new_heartbeat``; whatever it
does not apply (a stale fence, an ended lease, a replayed id, a row that moved while it
waited) wrote nothing and goes the long way, so its answer is its own
(docs/design.md, "Heartbeats, the call a pool makes most").
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text

from core.errors import DeliveryConflict, StaleHolder
from core.settings import Settings
from store import Envelope, PoolStore, worker
from tests.factories import NOW, envelope, given_running, row_state


@pytest.fixture
def settings(settings: Settings) -> Settings:
    return replace(settings, pool_size=8)  # a batch of six holders


def deliveries(store: PoolStore) -> dict[str, int]:
    with store.session(readonly=True) as s:
        return {r[0]: r[1] for r in s.execute(text("SELECT delivery_id, assignment_id FROM deliveries"))}


def checked(store: PoolStore, sent: dict[str, Any]) -> Envelope:
    return Envelope.parse(sent, pool_size=store.pool_size, with_result=False)


def end_lease(store: PoolStore, row_id: int, at: float) -> None:
    with store.session() as s:
        s.execute(text("UPDATE assignments SET lease_until = :at WHERE id = :id"), {"at": at, "id": row_id})


def test_one_statement_applies_the_fresh_heartbeats_and_writes_nothing_for_the_rest(store: PoolStore) -> None:
    fresh, stale, replayed, ended, other, last = (given_running(store, n, f"t{n}") for n in range(6))
    assert store.heartbeat(envelope(replayed, "r0"), now=NOW + 1) == "applied"
    end_lease(store, ended.row_id, NOW + 1)
    before = {o.row_id: row_state(store, o.row_id) for o in (stale, replayed, ended, other)}
    batch = [
        envelope(fresh, "f1"),
        envelope(stale, "s1", fence=stale.fence + 7),
        envelope(replayed, "r0"),
        envelope(ended, "e1"),
        envelope(other, "o1", payload_digest="0" * 64),
        envelope(last, "l1"),
    ]

    with store.connection() as conn:
        applied = worker.new_heartbeats(
            conn, [checked(store, e) for e in batch], lease_seconds=store.lease_seconds, now=NOW + 2
        )

    assert applied == [True, False, False, False, False, True]
    for offer in (fresh, last):
        assert row_state(store, offer.row_id)["lease_until"] == NOW + 2 + store.lease_seconds
    for row_id, row in before.items():
        assert row_state(store, row_id) == row
    assert deliveries(store) == {"r0": replayed.row_id, "f1": fresh.row_id, "l1": last.row_id}


def test_a_mixed_batch_gives_each_heartbeat_exactly_its_own_answer(store: PoolStore) -> None:
    first, second, stale, ended = (given_running(store, n, f"t{n}") for n in range(4))
    assert store.heartbeat(envelope(first, "h0"), now=NOW + 1) == "applied"
    end_lease(store, ended.row_id, NOW + 1)
    batch = [
        envelope(first, "h1"),
        envelope(stale, "s1", fence=stale.fence + 7),
        envelope(first, "h0"),  # a replay of a delivery committed earlier
        envelope(second, "h2"),
        envelope(first, "h3"),  # the same run again, in the same batch: after h1
        envelope(ended, "e1"),
        envelope(second, "h2"),  # a replay of one applied earlier in the same batch
        envelope(second, "h1", task_id="t1"),  # another's id: the second's own content differs
    ]

    answers = store.heartbeats([checked(store, e) for e in batch], now=NOW + 2)

    assert answers[:1] == ["applied"] and answers[2:5] == ["duplicate", "applied", "applied"]
    assert isinstance(answers[1], StaleHolder) and "fence" in str(answers[1])
    assert isinstance(answers[5], StaleHolder) and "lease" in str(answers[5])
    assert answers[6] == "duplicate"
    assert isinstance(answers[7], StaleHolder | DeliveryConflict)
    for offer in (first, second):
        assert row_state(store, offer.row_id)["lease_until"] == NOW + 2 + store.lease_seconds
    assert row_state(store, ended.row_id)["lease_until"] == NOW + 1
    assert deliveries(store) == {
        "h0": first.row_id,
        "h1": first.row_id,
        "h2": second.row_id,
        "h3": first.row_id,
    }


@pytest.mark.parametrize("backend_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_row_that_moves_while_the_statement_waits_for_it_is_refused_and_nothing_recorded(
    store: PoolStore,
) -> None:
    """PostgreSQL: the set statement's insert saw the holder, its update waited on the row's lock,
    and the row moved meanwhile: the delivery it recorded is taken back, the long way refuses."""
    held, other = given_running(store, 0, "t0"), given_running(store, 1, "t1")
    batch = [checked(store, envelope(held, "m1")), checked(store, envelope(other, "o1"))]
    answers: list[Any] = []
    with store.engine.connect() as mover:
        mover.execute(text("UPDATE assignments SET fence = fence + 100 WHERE id = :id"), {"id": held.row_id})
        waiting = threading.Thread(target=lambda: answers.extend(store.heartbeats(batch, now=NOW + 2)))
        waiting.start()
        deadline = time.monotonic() + 10
        while not _blocked_on_a_lock(store):
            assert time.monotonic() < deadline, "the batch never waited on the moved row"
            time.sleep(0.01)
        mover.commit()
    waiting.join(10)

    assert isinstance(answers[0], StaleHolder) and "fence" in str(answers[0])
    assert answers[1] == "applied"
    assert deliveries(store) == {"o1": other.row_id}


def _blocked_on_a_lock(store: PoolStore) -> bool:
    with store.engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT count(*) FROM pg_stat_activity"
                " WHERE wait_event_type = 'Lock' AND datname = current_database()"
            )
        ).scalar()
    return bool(found)


@pytest.mark.parametrize("backend_url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_a_batch_on_a_kept_connection_the_database_dropped_is_applied_on_a_new_one(store: PoolStore) -> None:
    """The batch writer keeps its connection between batches (no ping each time): one the
    database dropped meanwhile costs a retry on a new connection, not the batch's answers."""
    held = given_running(store, 0, "t0")
    assert store.heartbeats([checked(store, envelope(held, "k1"))], now=NOW + 1) == ["applied"]
    kept = store._kept.conn.connection.driver_connection.info.backend_pid
    with store.engine.connect() as admin:
        assert admin.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": kept}).scalar()

    assert store.heartbeats([checked(store, envelope(held, "k2"))], now=NOW + 2) == ["applied"]
    assert store._kept.conn.connection.driver_connection.info.backend_pid != kept
    assert deliveries(store) == {"k1": held.row_id, "k2": held.row_id}


def test_a_forked_child_never_writes_on_the_connection_its_parent_kept(store: PoolStore) -> None:
    held = given_running(store, 0, "t0")
    assert store.heartbeats([checked(store, envelope(held, "p1"))], now=NOW + 1) == ["applied"]
    parents = store._kept.conn

    child = os.fork()
    if child == 0:  # the child: its own connection, and the parent's left as it was
        ok = store.heartbeats([checked(store, envelope(held, "c1"))], now=NOW + 2) == ["applied"]
        os._exit(0 if ok and store._kept.conn is not parents else 1)
    _, status = os.waitpid(child, 0)

    assert os.waitstatus_to_exitcode(status) == 0
    assert store.heartbeats([checked(store, envelope(held, "p2"))], now=NOW + 3) == ["applied"]
    assert store._kept.conn is parents
    assert deliveries(store) == {"p1": held.row_id, "c1": held.row_id, "p2": held.row_id}

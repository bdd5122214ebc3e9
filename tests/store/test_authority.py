"""Execution authority: restart re-grant, fenced release, check before replay, fail closed.

Only the holder of the current fence may write; a stale holder is refused
before its delivery id is looked at, and nothing it sends is recorded
(docs/design.md, "Execution authority").
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from sqlalchemy import text

from core.errors import ConfigError, PoolError, StaleHolder, TransientError
from store import Envelope, PoolStore, audit, transitions, worker
from store.models import RowState
from tests.factories import NOW, OWNER, envelope, given_running, row_state

DONE = {"status": "done"}


def deliveries(store: PoolStore) -> list[Any]:
    with store.session(readonly=True) as s:
        return list(s.execute(text("SELECT * FROM deliveries ORDER BY delivery_id")))


def holder_events(store: PoolStore, row_id: int) -> list[tuple[Any, ...]]:
    """The row's audit events written by the worker protocol (others come from passes and operators)."""
    with store.session(readonly=True) as s:
        events = audit.history(s, row_id)
    fields = ("kind", "from", "to", "attempt", "fence", "actor")
    return [tuple(e[f] for f in fields) for e in events if e["kind"] in ("grant", "result", "release")]


def expire(store: PoolStore, row_id: int, now: float) -> RowState:
    with store.session() as s:
        return (
            transitions.expire_many(s, [row_id], max_attempts=store.max_attempts, now=now).moved[row_id].state
        )


# --- restart re-grant ----------------------------------------------------------


def test_a_restarted_worker_gets_its_run_back_at_once_and_fences_out_the_old_one(store: PoolStore) -> None:
    old = given_running(store)
    assert store.heartbeat(envelope(old, "h1"), now=NOW + 1) == "applied"

    new = store.offer(0, owner="w-2", now=NOW + 5)  # the same ordinal's worker, restarted

    assert new is not None
    assert (new.row_id, new.run_id, new.attempt, new.owner) == (old.row_id, old.run_id, old.attempt, "w-2")
    assert new.fence > old.fence and new.lease_until == NOW + 5 + store.lease_seconds
    row = row_state(store, old.row_id)
    assert (row["state"], row["fence"], row["owner"], row["attempt"]) == ("running", new.fence, "w-2", 1)
    recorded = deliveries(store)
    with pytest.raises(StaleHolder, match="fence"):
        store.heartbeat(envelope(old, "h2"), now=NOW + 6)
    with pytest.raises(StaleHolder, match="fence"):
        store.accept_result(envelope(old, "r1", payload=DONE), now=NOW + 6)
    with pytest.raises(StaleHolder, match="fence"):
        store.release(envelope(old, "x1"), now=NOW + 6)
    assert deliveries(store) == recorded
    assert row_state(store, old.row_id) == row
    assert store.heartbeat(envelope(new, "h3"), now=NOW + 7) == "applied"


def test_a_live_grant_never_moves_to_another_ordinal(store: PoolStore) -> None:
    old = given_running(store, ordinal=0)
    assert store.offer(1, owner="w-2", now=NOW + 1) is None
    assert row_state(store, old.row_id)["fence"] == old.fence


def test_a_restart_after_the_lease_ended_waits_for_expire_and_costs_the_attempt(store: PoolStore) -> None:
    old = given_running(store)
    late = old.lease_until + 1
    assert store.offer(0, owner="w-2", now=late) is None  # that attempt failed; expire decides
    assert row_state(store, old.row_id)["fence"] == old.fence
    assert expire(store, old.row_id, late) is RowState.ASSIGNED
    new = store.offer(0, owner="w-2", now=late)
    assert new is not None and new.attempt == 2 and new.fence > old.fence


# --- release -------------------------------------------------------------------


def test_release_reoffers_the_run_at_once_with_the_next_attempt(store: PoolStore) -> None:
    held = given_running(store)
    assert store.release(envelope(held, "x1"), now=NOW + 1) == "reoffered"
    row = row_state(store, held.row_id)
    assert (row["state"], row["attempt"], row["ordinal"]) == ("assigned", 2, 0)
    assert store.release(envelope(held, "x1"), now=NOW + 2) == "duplicate"  # a retry after a lost answer
    with pytest.raises(StaleHolder, match="state"):
        store.heartbeat(envelope(held, "h1"), now=NOW + 2)

    again = store.offer(0, owner=OWNER, now=NOW + 3)
    assert again is not None and (again.row_id, again.attempt) == (held.row_id, 2)
    assert again.fence > held.fence
    recorded = deliveries(store)
    with pytest.raises(StaleHolder, match="attempt"):  # a newer grant: the release is old news
        store.release(envelope(held, "x1"), now=NOW + 4)
    assert deliveries(store) == recorded
    assert row_state(store, held.row_id)["state"] == "running"


def test_release_at_the_last_attempt_is_lease_failed_and_frees_the_ordinal(store: PoolStore) -> None:
    held = given_running(store)
    t = NOW
    for _ in range(store.max_attempts - 1):
        t = held.lease_until + 1
        assert expire(store, held.row_id, t) is RowState.ASSIGNED
        got = store.offer(0, owner=OWNER, now=t)
        assert got is not None
        held = got
    assert held.attempt == store.max_attempts

    assert store.release(envelope(held, "x1"), now=t + 1) == "lease_failed"
    row = row_state(store, held.row_id)
    assert (row["state"], row["attempt"]) == ("lease_failed", store.max_attempts)
    assert store.release(envelope(held, "x1"), now=t + 2) == "duplicate"
    assert store.offer(0, owner=OWNER, now=t + 2) is None
    assert store.add_run(board="b", task_id="t2", run_id=1, ordinal=0, payload={}, now=t + 2) == "added"


@pytest.mark.parametrize(
    ("change", "field"),
    [("restart", "fence"), ("lease_ended", "lease"), ("result", "state"), ("other_attempt", "attempt")],
)
def test_release_by_anyone_but_the_current_holder_is_refused(
    store: PoolStore, change: str, field: str
) -> None:
    held = given_running(store)
    env, now = envelope(held, "x1"), NOW + 1
    if change == "restart":
        assert store.offer(0, owner="w-2", now=now) is not None
    elif change == "lease_ended":
        now = held.lease_until + 0.001
    elif change == "result":
        store.accept_result(envelope(held, "r1", payload=DONE), now=now)
    else:
        env["attempt"] += 1
    before, recorded = row_state(store, held.row_id), deliveries(store)
    with pytest.raises(StaleHolder, match=field):
        store.release(env, now=now)
    assert row_state(store, held.row_id) == before
    assert deliveries(store) == recorded


# --- check before replay -------------------------------------------------------


@pytest.mark.parametrize("fenced_out_by", ["restart", "lease_end", "expiry"])
def test_a_stale_holder_replaying_its_own_heartbeat_is_refused_and_nothing_is_recorded(
    store: PoolStore, fenced_out_by: str
) -> None:
    old = given_running(store)
    assert store.heartbeat(envelope(old, "h1"), now=NOW + 1) == "applied"
    now = NOW + 2 if fenced_out_by == "restart" else NOW + 1 + store.lease_seconds + 1  # h1's lease ended
    if fenced_out_by == "restart":
        assert store.offer(0, owner="w-2", now=now) is not None
    elif fenced_out_by == "expiry":
        expire(store, old.row_id, now)
    before, recorded = row_state(store, old.row_id), deliveries(store)
    with pytest.raises(StaleHolder):
        store.heartbeat(envelope(old, "h1"), now=now)
    assert row_state(store, old.row_id) == before
    assert deliveries(store) == recorded


def test_a_stale_holder_sending_the_result_already_stored_is_refused_and_not_recorded(
    store: PoolStore,
) -> None:
    old = given_running(store)
    new = store.offer(0, owner="w-2", now=NOW + 1)
    assert new is not None
    assert store.accept_result(envelope(new, "r-new", payload=DONE), now=NOW + 2) == "applied"
    recorded = deliveries(store)
    with pytest.raises(StaleHolder, match="fence"):  # same content, but not its result to give
        store.accept_result(envelope(old, "r-old", payload=DONE), now=NOW + 3)
    assert deliveries(store) == recorded


def test_the_holders_replay_after_its_own_result_is_a_duplicate(store: PoolStore) -> None:
    held = given_running(store)
    assert store.heartbeat(envelope(held, "h1"), now=NOW + 1) == "applied"
    result = envelope(held, "r1", payload=DONE)
    assert store.accept_result(result, now=NOW + 2) == "applied"
    late = held.lease_until + 100  # answers lost; the worker retries long after its lease
    assert store.accept_result(result, now=late) == "duplicate"
    assert store.heartbeat(envelope(held, "h1"), now=late) == "duplicate"
    assert store.accept_result({**result, "delivery_id": "r2"}, now=late) == "duplicate"
    with pytest.raises(StaleHolder, match="state"):  # a new heartbeat: there is no lease to extend
        store.heartbeat(envelope(held, "h2"), now=late)
    with store.session() as s:
        transitions.settle(
            s, held.row_id, RowState.FINALIZED, expect_state="result", expect_attempt=1, now=late
        )
    assert store.accept_result(result, now=late + 1) == "duplicate"


# --- concurrent replay -----------------------------------------------------------


@pytest.mark.parametrize("kind", ["heartbeat", "result", "release"])
def test_a_concurrent_replay_waits_for_the_first_delivery_and_is_a_duplicate(
    store: PoolStore, kind: str
) -> None:
    held = given_running(store)
    env = envelope(held, "d1", payload=DONE) if kind == "result" else envelope(held, "d1")
    parsed = Envelope.parse(env, pool_size=store.pool_size, with_result=kind == "result")
    apply: dict[str, Any] = {
        "heartbeat": lambda s: worker.heartbeat(s, parsed, lease_seconds=store.lease_seconds, now=NOW),
        "result": lambda s: worker.accept_result(s, parsed, now=NOW),
        "release": lambda s: worker.release(s, parsed, max_attempts=store.max_attempts, now=NOW),
    }
    call = {"heartbeat": store.heartbeat, "result": store.accept_result, "release": store.release}[kind]
    answers: dict[str, Any] = {}
    applied, commit = threading.Event(), threading.Event()

    def first() -> None:
        with store.session() as s:  # a transaction of its own, held open until told to commit
            answers["first"] = apply[kind](s)
            applied.set()
            commit.wait(10)

    def replay() -> None:
        try:
            answers["replay"] = call(env, now=NOW)
        except Exception as err:  # the answer under test: reported, not lost in the thread
            answers["replay"] = repr(err)

    t1 = threading.Thread(target=first)
    t1.start()
    assert applied.wait(10)
    t2 = threading.Thread(target=replay)
    t2.start()
    _wait_until_waiting(store, t2)
    commit.set()
    t1.join(10)
    t2.join(10)
    assert answers["replay"] == "duplicate"
    assert answers["first"] in ("applied", "reoffered")


def _wait_until_waiting(store: PoolStore, t: threading.Thread) -> None:
    """Until the replay waits on the first transaction's lock (PostgreSQL shows it; SQLite: a moment)."""
    if store.engine.dialect.name != "postgresql":
        time.sleep(0.3)
    else:
        deadline = time.monotonic() + 10
        with store.engine.connect() as conn:
            while not conn.execute(text("SELECT count(*) FROM pg_locks WHERE NOT granted")).scalar():
                assert time.monotonic() < deadline, "the replay never waited for the first delivery"
                conn.rollback()
                time.sleep(0.02)
    assert t.is_alive(), "the replay did not wait for the first delivery"


# --- fail closed -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "refusal"),
    [
        ("postgresql+psycopg://postgres@127.0.0.1:1/test", TransientError),  # a server that may come back
        ("sqlite:////nonexistent-dir/pool.db", ConfigError),  # a setting: no directory to open it in
    ],
    ids=["postgres", "sqlite"],
)
def test_nothing_is_granted_when_the_store_cannot_be_reached(url: str, refusal: type[PoolError]) -> None:
    store = PoolStore(url)
    try:
        with pytest.raises(refusal, match="pool store"):
            store.offer(0, owner=OWNER, now=NOW)
    finally:
        store.engine.dispose()


# --- audit trail -----------------------------------------------------------------


def test_a_grant_and_a_result_are_audited_once_and_heartbeats_and_replays_are_not(store: PoolStore) -> None:
    held = given_running(store)
    assert store.offer(0, owner=OWNER, now=NOW + 1) == held  # the same owner asking again: no new fence
    assert store.heartbeat(envelope(held, "h1"), now=NOW + 1) == "applied"
    assert store.accept_result(envelope(held, "r1", payload=DONE), now=NOW + 2) == "applied"
    assert store.accept_result(envelope(held, "r1", payload=DONE), now=NOW + 3) == "duplicate"
    assert store.accept_result(envelope(held, "r2", payload=DONE), now=NOW + 3) == "duplicate"

    assert holder_events(store, held.row_id) == [
        ("grant", "assigned", "running", 1, held.fence, "worker:0"),
        ("result", "running", "result", 1, held.fence, "worker:0"),
    ]


def test_a_restart_and_a_release_are_audited_and_a_refused_release_is_not(store: PoolStore) -> None:
    old = given_running(store)
    new = store.offer(0, owner="w-2", now=NOW + 1)
    assert new is not None
    with pytest.raises(StaleHolder):
        store.release(envelope(old, "x0"), now=NOW + 2)
    assert store.release(envelope(new, "x1"), now=NOW + 2) == "reoffered"
    assert store.release(envelope(new, "x1"), now=NOW + 3) == "duplicate"

    assert holder_events(store, old.row_id) == [
        ("grant", "assigned", "running", 1, old.fence, "worker:0"),
        ("grant", "running", "running", 1, new.fence, "worker:0"),
        ("release", "running", "assigned", 2, new.fence, "worker:0"),  # the row as it left it
    ]


# --- group commit (``PoolStore.heartbeats``: the server's batches) ---------------------------


def test_heartbeats_in_one_transaction_answer_each_alone_and_a_refused_one_fails_no_neighbour(
    store: PoolStore,
) -> None:
    first, second = given_running(store, 0, "t1"), given_running(store, 1, "t2")
    assert store.heartbeat(envelope(first, "h0"), now=NOW + 1) == "applied"
    stale = envelope(first, "h-stale", fence=first.fence + 7)

    def checked(offer_envelope: dict[str, Any]) -> Envelope:
        return Envelope.parse(offer_envelope, pool_size=store.pool_size, with_result=False)

    batch = [
        envelope(first, "h1"),
        stale,
        envelope(first, "h0"),
        envelope(second, "h2"),
        envelope(first, "h1"),
    ]
    answers = store.heartbeats([checked(e) for e in batch], now=NOW + 2)

    assert answers[0] == "applied" and answers[3] == "applied"
    assert isinstance(answers[1], StaleHolder) and "fence" in str(answers[1])
    assert answers[2] == "duplicate"  # a replay of a delivery committed earlier
    assert answers[4] == "duplicate"  # and of one applied earlier in the same transaction
    for offer in (first, second):
        assert row_state(store, offer.row_id)["lease_until"] == NOW + 2 + store.lease_seconds
    assert [d.delivery_id for d in deliveries(store)] == ["h0", "h1", "h2"]  # nothing of the stale one

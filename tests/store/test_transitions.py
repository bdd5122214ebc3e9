"""Each store transition: fixed clock, one unit either side of every cutoff, lost races reported."""

from __future__ import annotations

import random

import pytest
from sqlalchemy import text

from core.errors import (
    CorruptRow,
    DeliveryConflict,
    DuplicateIdentity,
    InvalidInput,
    LostRace,
    NotFound,
    OrdinalTaken,
    StaleHolder,
)
from core.retry import RetryPolicy
from core.settings import Settings
from store import PoolStore, bookkeeping, queries, transitions
from store.models import RowState
from tests.factories import NOW, OWNER, RowFactory, envelope, given_running, row_state

# --- add -------------------------------------------------------------------


def test_add_then_identical_add_is_a_noop(store: PoolStore) -> None:
    assert store.add_run(board="b", task_id="t", run_id=1, ordinal=0, payload={"a": 1}, now=NOW) == "added"
    assert (
        store.add_run(board="b", task_id="t", run_id=1, ordinal=0, payload={"a": 1}, now=NOW) == "duplicate"
    )
    with store.session() as s:
        assert queries.counts_by_state(s)["assigned"] == 1


def test_conflicting_duplicate_and_taken_ordinal_are_protocol_errors(store: PoolStore) -> None:
    store.add_run(board="b", task_id="t", run_id=1, ordinal=0, payload={"a": 1}, now=NOW)
    with pytest.raises(DuplicateIdentity):
        store.add_run(board="b", task_id="t", run_id=1, ordinal=1, payload={"a": 1}, now=NOW)
    with pytest.raises(OrdinalTaken):
        store.add_run(board="b", task_id="other", run_id=1, ordinal=0, payload={"a": 1}, now=NOW)
    with store.session() as s:
        assert sum(queries.counts_by_state(s).values()) == 1


@pytest.mark.parametrize(
    ("state", "duplicate"),
    [
        (RowState.ASSIGNED, True),
        (RowState.LEASE_FAILED, True),
        (RowState.FINALIZED, False),
        (RowState.STALE, False),
    ],
)
def test_an_identity_that_already_ended_is_refused_never_a_duplicate(
    store: PoolStore, make_row: RowFactory, state: RowState, duplicate: bool
) -> None:
    """Board run ids never repeat: a terminal row for the same run means the id was reused."""
    row = make_row(state, task_id="t", run_id=1, ordinal=0)  # its payload is {"title": "t"}
    before = row_state(store, row)

    def add() -> str:
        return store.add_run(board="b", task_id="t", run_id=1, ordinal=0, payload={"title": "t"}, now=NOW)

    if duplicate:
        assert add() == "duplicate"
    else:
        with pytest.raises(DuplicateIdentity, match=f"already ended as row {row} \\({state.value}\\)"):
            add()
    assert row_state(store, row) == before
    with store.session() as s:
        assert sum(queries.counts_by_state(s).values()) == 1


@pytest.mark.parametrize("ordinal", [-1, 3])
def test_add_refuses_ordinal_outside_the_pool(store: PoolStore, ordinal: int) -> None:
    with pytest.raises(InvalidInput, match="ordinal"):
        store.add_run(board="b", task_id="t", run_id=1, ordinal=ordinal, payload={}, now=NOW)


def test_add_refuses_credentials_in_the_payload(store: PoolStore) -> None:
    with pytest.raises(InvalidInput, match=r"payload\.env\.DB_PASSWORD"):
        store.add_run(
            board="b", task_id="t", run_id=1, ordinal=0, payload={"env": {"DB_PASSWORD": "hunter2"}}, now=NOW
        )
    with store.session() as s:
        assert sum(queries.counts_by_state(s).values()) == 0


# --- offer -------------------------------------------------------------------


def test_offer_starts_the_lease_with_a_new_fence(store: PoolStore) -> None:
    first = given_running(store, 0, "t1")
    second = given_running(store, 1, "t2")
    assert second.fence > first.fence
    assert first.lease_until == NOW + store.lease_seconds
    assert row_state(store, first.row_id)["state"] == "running"


def test_offer_gives_nothing_for_an_empty_ordinal_or_one_holding_a_result(store: PoolStore) -> None:
    assert store.offer(0, owner=OWNER, now=NOW) is None
    offer = given_running(store, 0)
    store.accept_result(envelope(offer, payload={"status": "done"}), now=NOW)
    assert store.offer(0, owner="w-2", now=NOW) is None


def test_offer_asked_again_by_its_holder_is_the_same_grant(store: PoolStore) -> None:
    first = given_running(store, 0)
    again = store.offer(0, owner=OWNER, now=NOW + 5)  # e.g. a retry after a lost answer
    assert again == first
    assert (row_state(store, first.row_id)["fence"], row_state(store, first.row_id)["lease_until"]) == (
        first.fence,
        first.lease_until,
    )


def test_reoffer_after_expiry_keeps_identity_with_new_fence(store: PoolStore) -> None:
    first = given_running(store, 0)
    with store.session() as s:
        assert (
            transitions.expire_many(s, [first.row_id], max_attempts=3, now=first.lease_until + 1)
            .moved[first.row_id]
            .state
            is RowState.ASSIGNED
        )
    again = store.offer(0, owner=OWNER, now=first.lease_until + 2)
    assert again is not None
    assert (again.row_id, again.task_id, again.run_id) == (first.row_id, first.task_id, first.run_id)
    assert again.attempt == 2 and again.fence > first.fence


@pytest.mark.parametrize(
    "stored",
    [
        "{broken",  # not JSON
        '{"title":"tampered"}',  # JSON, but not what add_run wrote (the digest says so)
        "[" * 5000 + "]" * 5000,  # deeper than the decoder can go
    ],
)
def test_offer_refuses_an_unreadable_row_and_records_it_until_quarantine(
    store: PoolStore, settings: Settings, stored: str
) -> None:
    store.add_run(board="b", task_id="bad", run_id=1, ordinal=0, payload={"title": "bad"}, now=NOW)
    store.add_run(board="b", task_id="ok", run_id=1, ordinal=1, payload={"title": "ok"}, now=NOW)
    with store.session() as s:
        s.execute(text("UPDATE assignments SET payload = :p WHERE task_id = 'bad'"), {"p": stored})

    def fences() -> int:
        with store.session() as s:
            return int(s.execute(text("SELECT value FROM fence_sequence")).scalar_one())

    before, fence = row_state(store, 1), fences()
    t = NOW
    for failures in range(1, settings.quarantine_after + 1):
        with pytest.raises(CorruptRow, match="row 1: the stored payload") as refused:
            store.offer(0, owner=OWNER, now=t)
        assert refused.value.row_id == 1
        with pytest.raises(CorruptRow):
            store.offer(0, owner=OWNER, now=t)  # a worker polling within the backoff adds no record
        got = row_state(store, 1)
        assert (got["failures"], bool(got["quarantined"])) == (
            failures,
            failures == settings.quarantine_after,
        )
        assert "row 1: the stored payload" in got["last_error"]
        bookkeeping_columns = ("failures", "last_error", "next_attempt_at", "quarantined")
        assert {k: v for k, v in got.items() if k not in bookkeeping_columns} == {
            k: v for k, v in before.items() if k not in bookkeeping_columns
        }, "nothing but the record changed: still assigned, no lease, no fence"
        t = got["next_attempt_at"]
    assert fences() == fence, "no fence was minted for a row that was not granted"
    with store.session() as s:
        assert [r.id for r in queries.rows(s, quarantined=True)] == [1]
    granted = store.offer(1, owner=OWNER, now=t)
    assert granted is not None and granted.task_id == "ok" and granted.fence == fence + 1


# --- heartbeat -------------------------------------------------------------


def test_heartbeat_extends_the_lease_up_to_its_last_instant(store: PoolStore) -> None:
    offer = given_running(store)
    at = offer.lease_until  # still valid at the very end of the lease
    assert store.heartbeat(envelope(offer), now=at) == "applied"
    assert row_state(store, offer.row_id)["lease_until"] == at + store.lease_seconds


def test_heartbeat_after_lease_end_is_refused(store: PoolStore) -> None:
    offer = given_running(store)
    with pytest.raises(StaleHolder, match="lease"):
        store.heartbeat(envelope(offer), now=offer.lease_until + 0.001)
    assert row_state(store, offer.row_id)["lease_until"] == offer.lease_until


@pytest.mark.parametrize(("field", "delta"), [("fence", 1), ("attempt", 1), ("worker_ordinal", 1)])
def test_heartbeat_from_a_stale_holder_is_refused(store: PoolStore, field: str, delta: int) -> None:
    offer = given_running(store)
    env = envelope(offer)
    env[field] += delta
    with pytest.raises(StaleHolder, match=field):
        store.heartbeat(env, now=NOW)
    assert row_state(store, offer.row_id)["lease_until"] == offer.lease_until


def test_replayed_heartbeat_is_a_duplicate_and_reused_id_conflicts(store: PoolStore) -> None:
    offer = given_running(store)
    assert store.heartbeat(envelope(offer), now=NOW) == "applied"
    assert store.heartbeat(envelope(offer), now=NOW + 1) == "duplicate"
    with pytest.raises(DeliveryConflict, match="delivery_id"):  # the holder reuses the id for a result
        store.accept_result(envelope(offer, payload={"status": "done"}), now=NOW + 1)
    with pytest.raises(StaleHolder, match="payload_digest"):  # authority is checked before the id
        store.heartbeat(envelope(offer, payload_digest="f" * 64), now=NOW + 1)


# --- result ----------------------------------------------------------------


def test_result_moves_the_row_to_result_once(store: PoolStore) -> None:
    offer = given_running(store)
    env = envelope(offer, "r1", payload={"status": "done", "answer": 42})
    assert store.accept_result(env, now=NOW) == "applied"
    assert store.accept_result(env, now=NOW) == "duplicate"
    assert store.accept_result({**env, "delivery_id": "r2"}, now=NOW) == "duplicate"
    with pytest.raises(DeliveryConflict, match="different result"):
        store.accept_result({**env, "delivery_id": "r3", "payload": {"status": "done", "answer": 7}}, now=NOW)
    row = row_state(store, offer.row_id)
    assert row["state"] == "result" and '"answer":42' in row["result"]


def test_result_from_the_previous_attempt_is_refused(store: PoolStore) -> None:
    old = given_running(store)
    with store.session() as s:
        transitions.expire_many(s, [old.row_id], max_attempts=3, now=old.lease_until + 1)
    new = store.offer(0, owner=OWNER, now=old.lease_until + 2)
    assert new is not None
    with pytest.raises(StaleHolder):
        store.accept_result(envelope(old, "r", payload={"status": "done"}), now=old.lease_until + 3)
    assert row_state(store, old.row_id)["state"] == "running"


# --- expire ----------------------------------------------------------------


def test_expire_due_rows_are_exactly_those_whose_lease_ended(store: PoolStore, make_row: RowFactory) -> None:
    due = make_row(RowState.RUNNING, ordinal=0, lease_until=NOW - 1)
    at_cutoff = make_row(RowState.RUNNING, ordinal=1, lease_until=NOW)
    make_row(RowState.ASSIGNED, ordinal=2)
    make_row(RowState.LEASE_FAILED, ordinal=0, lease_until=NOW - 100)
    with store.session() as s:
        assert [d.id for d in queries.due_expired(s, now=NOW, limit=10)] == [due]
        assert [d.id for d in queries.due_expired(s, now=NOW + 1, limit=10)] == [due, at_cutoff]


def test_expire_reoffers_until_the_last_attempt_then_lease_failed(
    store: PoolStore, make_row: RowFactory
) -> None:
    row = make_row(RowState.RUNNING, attempt=2, lease_until=NOW - 1)
    with store.session() as s:
        assert (
            transitions.expire_many(s, [row], max_attempts=3, now=NOW).moved[row].state is RowState.ASSIGNED
        )
    assert row_state(store, row)["attempt"] == 3
    offer = store.offer(0, owner=OWNER, now=NOW)
    assert offer is not None
    with store.session() as s:
        assert (
            transitions.expire_many(s, [row], max_attempts=3, now=offer.lease_until + 1).moved[row].state
            is RowState.LEASE_FAILED
        )
        assert queries.free_ordinals(s, 3) == [0, 1, 2]
    assert row_state(store, row)["attempt"] == 3


def test_expire_of_a_live_lease_or_other_state_moves_nothing(store: PoolStore, make_row: RowFactory) -> None:
    live = make_row(RowState.RUNNING, ordinal=0, lease_until=NOW)
    other = make_row(RowState.RESULT, ordinal=1, lease_until=NOW - 10)
    with store.session() as s:
        assert transitions.expire_many(s, [live, other], max_attempts=3, now=NOW) == ({}, {})
    assert row_state(store, live)["state"] == "running"
    assert row_state(store, other)["state"] == "result"


# --- settle and gc -----------------------------------------------------------


def test_settle_compacts_json_but_keeps_digests(store: PoolStore, make_row: RowFactory) -> None:
    row = make_row(RowState.RESULT)
    with store.session() as s:
        transitions.settle(s, row, RowState.FINALIZED, expect_state="result", expect_attempt=1, now=NOW)
    got = row_state(store, row)
    assert got["state"] == "finalized" and got["payload"] is None and got["result"] is None
    assert got["payload_digest"] and got["result_digest"] == "0" * 64


def test_settle_with_a_stale_attempt_is_a_lost_race(store: PoolStore, make_row: RowFactory) -> None:
    row = make_row(RowState.LEASE_FAILED, attempt=3)
    with pytest.raises(LostRace), store.session() as s:
        transitions.settle(s, row, RowState.STALE, expect_state="lease_failed", expect_attempt=2, now=NOW)
    assert row_state(store, row)["state"] == "lease_failed"


def test_gc_deletes_only_terminal_rows_past_retention(
    store: PoolStore, settings: Settings, make_row: RowFactory
) -> None:
    cutoff = NOW - settings.retention_seconds
    old_final = make_row(RowState.FINALIZED, updated_at=cutoff - 1)
    old_stale = make_row(RowState.STALE, updated_at=cutoff - 1)
    young = make_row(RowState.FINALIZED, updated_at=cutoff)
    failed = make_row(RowState.LEASE_FAILED, ordinal=0, updated_at=cutoff - 10_000)
    live = make_row(RowState.RUNNING, ordinal=1, lease_until=cutoff - 1, updated_at=cutoff - 10_000)
    with store.session() as s:
        assert transitions.collect_garbage(s, retention_seconds=3600, batch=1, now=NOW)[0] == 1
        assert transitions.collect_garbage(s, retention_seconds=3600, batch=10, now=NOW)[0] == 1
        assert transitions.collect_garbage(s, retention_seconds=3600, batch=10, now=NOW)[0] == 0
        left = set(s.scalars(text("SELECT id FROM assignments")))
    assert left == {young, failed, live}
    assert not left & {old_final, old_stale}


# --- bookkeeping -------------------------------------------------------------


def test_failures_back_off_then_quarantine_and_requeue_resets(
    store: PoolStore, settings: Settings, make_row: RowFactory
) -> None:
    policy = RetryPolicy.from_settings(settings)
    row = make_row(RowState.LEASE_FAILED)
    rng = random.Random(1)
    delays = []
    for n in range(1, 4):
        with store.session() as s:
            f = bookkeeping.record_failure(s, row, "boom", policy=policy, now=NOW, rng=rng)
        delays.append(f.next_attempt_at - NOW)
        assert f.failures == n and f.new_detail == (n == 1)
    base = settings.backoff_base_seconds
    assert base / 2 <= delays[0] <= base and 2 * base / 2 <= delays[1] <= 2 * base
    assert f.quarantined and delays[2] == settings.quarantine_retry_seconds
    with store.session() as s:
        assert queries.due_in_state(s, RowState.LEASE_FAILED, now=NOW, limit=5) == []
        assert [
            d.id for d in queries.due_in_state(s, RowState.LEASE_FAILED, now=f.next_attempt_at, limit=5)
        ] == [row]
        transitions.requeue(s, row, now=NOW)
        assert [d.id for d in queries.due_in_state(s, RowState.LEASE_FAILED, now=NOW, limit=5)] == [row]
    got = row_state(store, row)
    assert got["failures"] == 0 and not got["quarantined"] and got["state"] == "lease_failed"


def test_transient_failures_delay_without_nearing_quarantine(
    store: PoolStore, settings: Settings, make_row: RowFactory
) -> None:
    policy = RetryPolicy.from_settings(settings)
    row = make_row(RowState.LEASE_FAILED)
    for _ in range(5):
        with store.session() as s:
            f = bookkeeping.record_failure(s, row, "busy", policy=policy, now=NOW, counts=False)
    assert f.failures == 0 and not f.quarantined and f.next_attempt_at > NOW


def test_requeue_refuses_a_terminal_row_and_changes_nothing(store: PoolStore, make_row: RowFactory) -> None:
    row = make_row(RowState.FINALIZED)
    before = row_state(store, row)
    with pytest.raises(InvalidInput, match="terminal"), store.session() as s:
        transitions.requeue(s, row, now=NOW)
    assert row_state(store, row) == before


def test_unknown_row_is_not_found(store: PoolStore) -> None:
    with pytest.raises(NotFound, match="row 99"), store.session() as s:
        transitions.requeue(s, 99, now=NOW)


def test_row_ids_are_never_reused_after_gc(store: PoolStore, make_row: RowFactory) -> None:
    old = make_row(RowState.FINALIZED, updated_at=NOW - 2 * 3600)
    with store.session() as s:
        assert transitions.collect_garbage(s, retention_seconds=3600, batch=10, now=NOW) == (1, 0)
    assert make_row(RowState.ASSIGNED) > old


def test_expire_is_progress_and_ends_the_failure_streak(
    store: PoolStore, settings: Settings, make_row: RowFactory
) -> None:
    row = make_row(RowState.RUNNING, lease_until=NOW - 1)
    with store.session() as s:
        bookkeeping.record_failure(s, row, "boom", policy=RetryPolicy(quarantine_after=1), now=NOW)
    assert row_state(store, row)["quarantined"]
    with store.session() as s:
        assert transitions.expire_many(s, [row, 999], max_attempts=3, now=NOW) == (
            {row: transitions.Expiry(RowState.ASSIGNED, NOW - 1)},
            {},
        )
    got = row_state(store, row)
    assert (got["failures"], got["last_error"], got["next_attempt_at"], bool(got["quarantined"])) == (
        0,
        None,
        0,
        False,
    )

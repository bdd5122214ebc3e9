"""The audit trail: one event per transition, in its transaction, replaying to the row's state.

Every test runs on SQLite and on PostgreSQL (the ``store`` fixture). ``store.worker``
(grant, result, release) is not wired here: a worker step may leave a gap in a
trail, which the property below allows only where such a step happened.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from sqlalchemy import text

from board import Board
from core.errors import DuplicateIdentity, InvalidInput, LostRace, NotFound, OrdinalTaken, PoolError
from core.retry import RetryPolicy
from poolkeeper import operator
from store import Offer, PoolStore, audit, bookkeeping, queries, transitions
from store.models import Delivery, EventKind, RowState
from tasks import failures, gc, registry, runner
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tests.factories import NOW, OWNER, RowFactory, envelope, given_running, grant, row_state
from tests.helpers import poolctl
from tests.properties import budget

MATERIALIZE, EXPIRE = audit.by_pass("materialize"), audit.by_pass("expire")


def trail(store: PoolStore, row_id: int) -> list[dict[str, Any]]:
    with store.session(readonly=True) as s:
        return audit.history(s, row_id)


def brief(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """(kind, from, to, attempt, fence, actor) of each event."""
    return [(e["kind"], e["from"], e["to"], e["attempt"], e["fence"], e["actor"]) for e in events]


def event_count(store: PoolStore) -> int:
    with store.session(readonly=True) as s:
        return int(s.scalar(text("SELECT count(*) FROM audit_events")) or 0)


def expired(store: PoolStore, row_ids: list[int], now: float, max_attempts: int = 3) -> dict[int, Any]:
    with store.session() as s:
        return transitions.expire_many(s, row_ids, max_attempts=max_attempts, now=now, actor=EXPIRE).moved


# --- one event per transition ---------------------------------------------------


def test_add_run_records_one_claim_and_a_duplicate_none(store: PoolStore) -> None:
    def add(ordinal: int = 0) -> str:
        with store.session() as s:
            return transitions.add_run(
                s,
                board="b",
                task_id="t",
                run_id=1,
                ordinal=ordinal,
                payload={},
                pool_size=3,
                now=NOW,
                actor=MATERIALIZE,
            )

    assert add() == "added"
    assert add() == "duplicate"
    with pytest.raises(DuplicateIdentity):
        add(ordinal=1)
    [event] = trail(store, 1)
    assert brief([event]) == [("claim", None, "assigned", 1, None, MATERIALIZE)]
    assert event["at"] == NOW and event["detail"] == "b/t run 1 on ordinal 0"


def test_expiry_records_the_fenced_out_holder_then_the_last_attempt(store: PoolStore) -> None:
    first = given_running(store)
    expired(store, [first.row_id], first.lease_until + 1, max_attempts=2)
    second = store.offer(0, owner=OWNER, now=first.lease_until + 2)
    assert second is not None
    expired(store, [first.row_id], second.lease_until + 1, max_attempts=2)
    worker = audit.by_worker(0)
    assert brief(trail(store, first.row_id))[1:] == [
        ("grant", "assigned", "running", 1, first.fence, worker),
        ("expiry", "running", "assigned", 2, first.fence, EXPIRE),
        ("grant", "assigned", "running", 2, second.fence, worker),
        ("expiry", "running", "lease_failed", 2, second.fence, EXPIRE),
    ]


def test_expire_many_of_n_rows_writes_n_events_in_one_statement(
    store: PoolStore, make_row: RowFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    ended = [make_row(RowState.RUNNING, ordinal=i, lease_until=NOW - 1) for i in range(5)]
    live = make_row(RowState.RUNNING, ordinal=5, lease_until=NOW + 30)
    calls: list[list[int]] = []
    real = audit.expired

    def counted(conn: Any, row_ids: list[int], **kw: Any) -> None:
        calls.append(list(row_ids))
        real(conn, row_ids, **kw)

    built: list[str] = []
    real_from = audit.expired_from

    def built_from(rows: str, p: str) -> str:  # PostgreSQL: the events are part of the UPDATE
        built.append(rows)
        return real_from(rows, p)

    monkeypatch.setattr(audit, "expired", counted)
    monkeypatch.setattr(audit, "expired_from", built_from)
    assert set(expired(store, [*ended, live, 999], NOW)) == set(ended)
    if store.engine.dialect.name == "postgresql":
        assert (calls, built) == ([], ["moved"])
    else:
        assert (calls, built) == ([ended], [])
    assert event_count(store) == 5
    for row_id in ended:
        fence = row_state(store, row_id)["fence"]
        assert brief(trail(store, row_id)) == [("expiry", "running", "assigned", 2, fence, EXPIRE)]
    assert trail(store, live) == []


def test_settle_records_its_evidence_and_a_lost_race_nothing(store: PoolStore, make_row: RowFactory) -> None:
    row = make_row(RowState.RESULT, attempt=2)
    fence = row_state(store, row)["fence"]
    with pytest.raises(LostRace), store.session() as s:
        transitions.settle(s, row, RowState.FINALIZED, expect_state="result", expect_attempt=1, now=NOW)
    assert trail(store, row) == []
    with store.session() as s:
        transitions.settle(
            s,
            row,
            RowState.FINALIZED,
            expect_state="result",
            expect_attempt=2,
            now=NOW,
            actor=audit.by_pass("results"),
            evidence="board: completed the run with the result",
        )
    [event] = trail(store, row)
    assert brief([event]) == [("settle", "result", "finalized", 2, fence, "pass:results")]
    assert event["detail"] == "board: completed the run with the result"


def test_the_event_is_in_the_transitions_transaction(store: PoolStore, make_row: RowFactory) -> None:
    row = make_row(RowState.LEASE_FAILED)
    with pytest.raises(RuntimeError), store.session() as s:
        transitions.settle(s, row, RowState.STALE, expect_state="lease_failed", expect_attempt=1, now=NOW)
        raise RuntimeError("the process dies before the commit")
    assert trail(store, row) == [] and row_state(store, row)["state"] == "lease_failed"


def test_refused_requeue_and_unknown_rows_write_nothing(store: PoolStore, make_row: RowFactory) -> None:
    row = make_row(RowState.STALE)
    make_row(RowState.ASSIGNED)  # ordinal 0 holds a live row
    with pytest.raises(InvalidInput), store.session() as s:
        transitions.requeue(s, row, now=NOW, actor=audit.OPERATOR)
    with pytest.raises(NotFound), store.session() as s:
        transitions.requeue(s, 999, now=NOW, actor=audit.OPERATOR)
    with pytest.raises(OrdinalTaken), store.session() as s:
        transitions.add_run(s, board="b", task_id="x", run_id=1, ordinal=0, payload={}, pool_size=3, now=NOW)
    assert event_count(store) == 0


def test_requeue_records_what_it_cleared(store: PoolStore, make_row: RowFactory) -> None:
    row = make_row(RowState.LEASE_FAILED, attempt=3)
    policy = RetryPolicy(quarantine_after=2)
    for _ in range(2):
        with store.session() as s:
            bookkeeping.record_failure(s, row, "boom", policy=policy, now=NOW)
    with store.session() as s:
        transitions.requeue(s, row, now=NOW + 1, actor=audit.OPERATOR)
    event = trail(store, row)[-1]
    assert brief([event]) == [("requeue", "lease_failed", "lease_failed", 3, event["fence"], "operator")]
    assert event["detail"] == "cleared 2 failure(s) and quarantine"


def test_each_recorded_failure_is_an_event_and_the_threshold_a_quarantine(
    store: PoolStore, make_row: RowFactory
) -> None:
    rows = [make_row(RowState.RESULT, ordinal=i) for i in range(3)]
    policy, by = RetryPolicy(quarantine_after=2), audit.by_pass("results")
    for _ in range(3):
        with store.session() as s:  # one batch of three rows
            bookkeeping.record_failures(s, {r: f"boom {r}" for r in rows}, policy=policy, now=NOW, actor=by)
    with store.session() as s:
        bookkeeping.record_failure(s, rows[0], "busy", policy=policy, now=NOW, counts=False, actor=by)
    for row in rows:
        assert [e["kind"] for e in trail(store, row)][:3] == ["failure", "quarantine", "failure"]
        assert {(e["from"], e["to"], e["actor"], e["detail"]) for e in trail(store, row)[:3]} == {
            ("result", "result", by, f"boom {row}")
        }
    assert trail(store, rows[0])[-1]["detail"] == "busy"


def test_retiring_children_is_one_event_per_run_that_had_any(store: PoolStore) -> None:
    parent, alone, single = (given_running(store, i, f"t{i}") for i in range(3))
    for _ in range(2):
        store.register_child(grant(parent), now=NOW)
    store.register_child(grant(single), now=NOW)
    expired(store, [parent.row_id, alone.row_id], parent.lease_until + 1)  # a batch: RETURNING row_id
    with store.session() as s:  # one run: its row count
        by = audit.by_pass("reconcile")
        transitions.settle(
            s, single.row_id, RowState.STALE, expect_state="running", expect_attempt=1, now=NOW, actor=by
        )
    assert [e["kind"] for e in trail(store, alone.row_id)] == ["claim", "grant", "expiry"]
    *_, expiry, retired = trail(store, parent.row_id)
    assert expiry["kind"] == "expiry"
    assert brief([retired]) == [("children_retired", "assigned", "assigned", 2, parent.fence, EXPIRE)]
    assert retired["detail"] == "2 child execution(s) retired"
    *_, settled, retired = trail(store, single.row_id)
    assert brief([settled, retired]) == [
        ("settle", "running", "stale", 1, single.fence, by),
        ("children_retired", "stale", "stale", 1, single.fence, by),
    ]
    assert retired["detail"] == "1 child execution(s) retired"


# --- the plane and the operator name themselves ------------------------------------


def test_passes_and_operator_write_attributed_events_of_the_most_specific_kind(
    plane: Plane, kanban: Board, store: PoolStore
) -> None:
    for i in range(3):
        kanban.add_task("b", f"task {i}", task_id=f"t{i}")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 3}
    offers = [store.offer(i, owner=OWNER, now=NOW) for i in range(3)]
    assert all(offers)
    done, hung, poisoned = (o for o in offers if o is not None)
    store.accept_result(envelope(done, "r1", payload={"status": "done"}), now=NOW + 1)
    late = hung.lease_until + 1
    summary = maintain_once(plane, late)
    assert (summary["expire"], summary["results"]) == ({"reoffered": 2}, {"finalized": 1})
    results = registry.get("results")
    failures.record(plane, results, [(poisoned.row_id, ValueError("poisoned"))], late, counts=True)
    got = operator.abandon(kanban, store, hung.row_id, "stuck", late)
    assert got.settled is not None
    operator.cancel(kanban, store, "b", poisoned.task_id, late)

    worker = audit.by_worker(done.ordinal)
    assert brief(trail(store, done.row_id)) == [
        ("claim", None, "assigned", 1, None, MATERIALIZE),
        ("grant", "assigned", "running", 1, done.fence, worker),
        ("result", "running", "result", 1, done.fence, worker),
        ("settle", "result", "finalized", 1, done.fence, "pass:results"),
    ]
    assert trail(store, done.row_id)[-1]["detail"] == "board: completed the run with the result"
    *_, abandoned = trail(store, hung.row_id)
    assert brief([abandoned]) == [("abandon", "assigned", "stale", 2, hung.fence, "operator")]
    assert abandoned["detail"] == "abandoned by operator: stuck"
    kinds = ["claim", "grant", "expiry", "failure", "cancel"]
    assert [e["kind"] for e in trail(store, poisoned.row_id)] == kinds
    assert trail(store, poisoned.row_id)[3]["actor"] == "pass:results"
    for row in (hung.row_id, poisoned.row_id):  # one event per transition: no settle beside it
        assert "settle" not in [e["kind"] for e in trail(store, row)]
    with store.session(readonly=True) as s:
        actors = set(s.scalars(text("SELECT DISTINCT actor FROM audit_events")))
    workers = {audit.by_worker(r.ordinal) for r in (done, hung, poisoned)}
    assert actors == {MATERIALIZE, EXPIRE, "pass:results", "operator", *workers}  # never UNATTRIBUTED


# --- poolctl rows ROW --history ---------------------------------------------------------


@pytest.fixture
def cli_store(tmp_path: Path) -> Iterator[PoolStore]:
    assert poolctl(tmp_path, "init").returncode == 0
    st = PoolStore(f"sqlite:///{tmp_path}/pool.db", pool_size=2)
    yield st
    st.engine.dispose()


def test_history_prints_the_timeline_and_json(tmp_path: Path, cli_store: PoolStore) -> None:
    offer = given_running(cli_store)
    expired(cli_store, [offer.row_id], offer.lease_until + 1)
    cli_store.add_run(board="b", task_id="quiet", run_id=1, ordinal=1, payload={}, now=NOW)
    with cli_store.session() as s:
        s.execute(text("DELETE FROM audit_events WHERE row_id = 2"))

    shown = poolctl(tmp_path, "rows", str(offer.row_id), "--history", env={"COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    assert "running → assigned" in shown.stdout and "pass:expire" in shown.stdout
    assert "2027-01-15 08:00:00" in shown.stdout  # NOW, in UTC
    data = json.loads(poolctl(tmp_path, "rows", str(offer.row_id), "--history", "--json").stdout)
    assert [(e["kind"], e["from"], e["to"], e["attempt"]) for e in data["history"]] == [
        ("claim", None, "assigned", 1),
        ("grant", "assigned", "running", 1),
        ("expiry", "running", "assigned", 2),
    ]
    assert data["state"] == "assigned" and data["history"][2]["fence"] == offer.fence
    quiet = poolctl(tmp_path, "rows", "2", "--history")
    assert quiet.returncode == 0 and "no recorded events" in quiet.stdout
    assert json.loads(poolctl(tmp_path, "rows", "2", "--history", "--json").stdout)["history"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--history"], "--history: needs a ROW"),
        (["99", "--history"], "row 99: no such row"),
        (["0", "--history"], "row"),
        (["x", "--history"], "Invalid value for 'row'"),
    ],
)
def test_history_refuses_bad_input_in_one_line(
    tmp_path: Path, cli_store: PoolStore, args: list[str], message: str
) -> None:
    done = poolctl(tmp_path, "rows", *args)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and message in done.stderr


# --- the trail replays to the row's state -----------------------------------------------

POOL, MAX_ATTEMPTS, LEASE = 3, 2, 30.0
POLICY = RetryPolicy(quarantine_after=2)


class TrailMachine(RuleBasedStateMachine):
    """Random transitions; after each step every row's trail is what the model expects, and replays.

    ``expected[row]`` is the model's own account of the events (kind, from, to,
    attempt, fence, actor), worker steps (grant, result, release) included.
    """

    store: ClassVar[PoolStore]  # the test's, on SQLite or PostgreSQL: emptied for each example

    def __init__(self) -> None:
        super().__init__()
        with self.store.session() as s:
            s.execute(text("DELETE FROM child_executions"))
            s.execute(text("DELETE FROM deliveries"))
            s.execute(text("DELETE FROM audit_events"))
            s.execute(text("DELETE FROM assignments"))
        self.now = NOW
        self.runs = 0
        self.rows: list[int] = []
        self.offers: dict[int, Offer] = {}
        self.expected: dict[int, list[tuple[Any, ...]]] = {}

    def _row(self, row_id: int) -> dict[str, Any]:
        return row_state(self.store, row_id)

    def _drawn(self, data: st.DataObject) -> tuple[int, dict[str, Any]]:
        """One of the rows, and how it stands before the step."""
        row_id = data.draw(st.sampled_from(self.rows))
        return row_id, self._row(row_id)

    @rule(ordinal=st.integers(0, POOL - 1))
    def add(self, ordinal: int) -> None:
        self.runs += 1
        try:
            with self.store.session() as s:
                transitions.add_run(
                    s,
                    board="b",
                    task_id=f"t{self.runs}",
                    run_id=1,
                    ordinal=ordinal,
                    payload={},
                    pool_size=POOL,
                    now=self.now,
                    actor=MATERIALIZE,
                )
                row_id = int(s.scalar(text("SELECT max(id) FROM assignments")) or 0)
        except OrdinalTaken:
            return
        self.rows.append(row_id)
        self.expected[row_id] = [("claim", None, "assigned", 1, None, MATERIALIZE)]

    @rule(ordinal=st.integers(0, POOL - 1), owner=st.sampled_from([OWNER, "w-2"]))
    def offer(self, ordinal: int, owner: str) -> None:
        with self.store.session(readonly=True) as s:
            held = s.scalar(
                text("SELECT id FROM assignments WHERE ordinal = :o AND state IN ('assigned', 'running')"),
                {"o": ordinal},
            )
        before = self._row(held) if held else None
        got = self.store.offer(ordinal, owner=owner, now=self.now)
        if got is not None and before is not None:
            self.offers[got.row_id] = got
            if got.fence != before["fence"]:  # a new grant; the same owner asking again is no transition
                by = audit.by_worker(ordinal)
                event = ("grant", before["state"], "running", got.attempt, got.fence, by)
                self.expected[got.row_id].append(event)

    @precondition(lambda self: self.offers)
    @rule(data=st.data(), release=st.booleans())
    def deliver(self, data: st.DataObject, release: bool) -> None:
        offer = data.draw(st.sampled_from(sorted(self.offers.values(), key=lambda o: o.row_id)))
        self.runs += 1
        got: str
        try:
            if release:
                got = self.store.release(envelope(offer, f"d{self.runs}"), now=self.now)
            else:
                got = self.store.accept_result(
                    envelope(offer, f"d{self.runs}", payload={"status": "done"}), now=self.now
                )
        except PoolError:
            return  # refused: no event
        if got == "duplicate":  # the holder's result again, under a new delivery id: no transition
            return
        to, attempt = {
            "applied": ("result", offer.attempt),
            "reoffered": ("assigned", offer.attempt + 1),
            "lease_failed": ("lease_failed", offer.attempt),
        }[got]
        kind = "release" if release else "result"
        by = audit.by_worker(offer.ordinal)
        self.expected[offer.row_id].append((kind, "running", to, attempt, offer.fence, by))

    @rule(dt=st.sampled_from([0.0, 10.0, LEASE + 1]))
    def tick(self, dt: float) -> None:
        self.now += dt

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        row_id, b = self._drawn(data)
        with self.store.session() as s:
            got = transitions.expire_many(s, [row_id], max_attempts=MAX_ATTEMPTS, now=self.now, actor=EXPIRE)
        assert not got.refused
        if row_id not in got.moved:  # lost its race: not running with an ended lease
            assert not (b["state"] == "running" and (b["lease_until"] or 0) < self.now)
            return
        last = b["attempt"] >= MAX_ATTEMPTS
        to, attempt = ("lease_failed", b["attempt"]) if last else ("assigned", b["attempt"] + 1)
        self.expected[row_id].append(("expiry", "running", to, attempt, b["fence"], EXPIRE))

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), to=st.sampled_from([RowState.FINALIZED, RowState.STALE]), stale_read=st.booleans())
    def settle(self, data: st.DataObject, to: RowState, stale_read: bool) -> None:
        row_id, b = self._drawn(data)
        if b["state"] in ("finalized", "stale"):
            return  # the passes settle only rows that are not terminal
        by = audit.by_pass("reconcile")
        try:
            with self.store.session() as s:
                transitions.settle(
                    s,
                    row_id,
                    to,
                    expect_state=b["state"],
                    expect_attempt=b["attempt"] + stale_read,
                    now=self.now,
                    actor=by,
                    evidence="board: the task is gone",
                )
        except LostRace:
            assert stale_read
            return
        self.offers.pop(row_id, None)
        self.expected[row_id].append(("settle", b["state"], to.value, b["attempt"], b["fence"], by))

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def requeue(self, data: st.DataObject) -> None:
        row_id, b = self._drawn(data)
        try:
            with self.store.session() as s:
                transitions.requeue(s, row_id, now=self.now, actor=audit.OPERATOR)
        except InvalidInput:
            assert b["state"] in ("finalized", "stale")
            return
        self.expected[row_id].append(
            ("requeue", b["state"], b["state"], b["attempt"], b["fence"], "operator")
        )

    @precondition(lambda self: self.rows)
    @rule(data=st.data(), counts=st.booleans())
    def fail(self, data: st.DataObject, counts: bool) -> None:
        row_id, b = self._drawn(data)
        by = audit.by_pass("results")
        with self.store.session() as s:
            f = bookkeeping.record_failure(
                s, row_id, "boom", policy=POLICY, now=self.now, counts=counts, actor=by, rng=random.Random(0)
            )
        kind = "quarantine" if f.quarantined and not b["quarantined"] else "failure"
        self.expected[row_id].append((kind, b["state"], b["state"], b["attempt"], b["fence"], by))

    @invariant()
    def the_trail_replays(self) -> None:
        for row_id in self.rows:
            events = trail(self.store, row_id)
            assert brief(events) == self.expected[row_id]
            for before, after in itertools.pairwise(events):
                assert before["to"] == after["from"], (row_id, events)
            row, last = self._row(row_id), events[-1]
            assert (last["to"], last["attempt"], last["fence"]) == (
                row["state"],
                row["attempt"],
                row["fence"],
            )


@pytest.mark.property
def test_the_trail_replays_to_each_rows_state(store: PoolStore) -> None:
    run_state_machine_as_test(
        type("OnThisBackend", (TrailMachine,), {"store": store}), settings=budget(60, 25)
    )


def test_caught_text_is_stored_safely_on_every_backend(store: PoolStore) -> None:
    """Error text and evidence come from elsewhere: NUL and lone surrogates are replaced, never fatal."""
    offer = given_running(store)
    nasty = "bad \x00 byte and \ud800 surrogate " + "x" * 1000
    with store.session() as s:
        got = bookkeeping.record_failure(
            s, offer.row_id, nasty, policy=RetryPolicy(), now=NOW, actor=f"pass:\x00{nasty}"
        )
    assert got.failures == 1
    row = row_state(store, offer.row_id)
    assert row["last_error"].startswith("bad \ufffd byte and ? surrogate") and len(row["last_error"]) == 500
    event = trail(store, offer.row_id)[-1]
    assert event["kind"] == "failure" and event["detail"] == row["last_error"]
    assert "\x00" not in event["actor"] and len(event["actor"]) == audit.MAX_ACTOR_CHARS


def test_gc_keeps_the_newest_event_so_the_written_count_never_starts_again(store: PoolStore) -> None:
    event = audit.Event(1, EventKind.FAILURE, EXPIRE, "running", "running", 1, 1)
    events = [event._replace(detail=f"e{i}") for i in range(5)]
    with store.session() as s:
        audit.append(s, events, now=NOW)
    with store.session() as s:
        assert audit.collect(s, cutoff=NOW + 1, batch=100) == 4  # all old; the newest stays
    with store.session() as s:
        audit.append(s, events[:1], now=NOW + 2)
    with store.session(readonly=True) as s:
        assert queries.audit_events_written(s) == 6
    assert [e["detail"] for e in trail(store, 1)] == ["e4", "e0"]


def test_gc_on_an_empty_audit_table_still_collects_rows_and_deliveries(
    plane: Plane, store: PoolStore, make_row: RowFactory
) -> None:
    """A fresh store, or one upgraded from 0003 with only terminal rows, has no events yet."""
    retention = plane.settings.retention_seconds
    now = NOW + 2 * retention
    old = [
        make_row(state, ordinal=i, updated_at=NOW)
        for i, state in enumerate((RowState.FINALIZED, RowState.STALE))
    ]
    kept = make_row(RowState.FINALIZED, ordinal=2, updated_at=now - retention + 1)
    with store.session() as s:
        s.add(
            Delivery(
                delivery_id="d-old", assignment_id=old[0], kind="heartbeat", digest="0" * 64, created_at=NOW
            )
        )
    assert event_count(store) == 0
    with store.session() as s:
        assert audit.collect(s, cutoff=now, batch=10) == 0
    assert gc.collect(plane, now) == gc.Collected(rows=2, deliveries=1)
    with store.session(readonly=True) as s:
        assert [r.id for r in queries.rows(s)] == [kept]
    assert runner.run_key(plane, "gc", "all", now) == "nothing"

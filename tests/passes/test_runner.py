"""How every pass runs: ``maintain_once``, the failure reporter, batches split around poisoned rows."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from hypothesis import given
from hypothesis import strategies as st
from sqlalchemy import text

from board import Board, TaskStatus
from core import db
from core.errors import TransientError
from core.isolate import isolate
from store import PoolStore, audit, bookkeeping, transitions
from store.models import RowState
from tasks import failures, registry, runner
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tests.factories import NOW, OWNER, deliver, row_state
from tests.properties import budget


def test_maintain_once_runs_a_claim_to_the_board(plane: Plane, kanban: Board) -> None:
    kanban.add_task("b", "x", task_id="x")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 1}
    offer = plane.store.offer(0, owner=OWNER, now=NOW)
    assert offer is not None
    row = offer.row_id
    deliver(plane, row, {"status": "done"})
    assert maintain_once(plane, NOW)["results"] == {"finalized": 1}
    assert kanban.get_task("b", "x").status is TaskStatus.DONE  # type: ignore[union-attr]


def test_reporter_logs_each_distinct_detail_once_with_bounded_memory(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rep = failures.Reporter(size=2)
    caplog.set_level(logging.INFO, "poolkeeper")
    for detail in ["a", "a", "b", "b", "a"]:
        rep.once("expire", "1", detail)
    for key in "234":
        rep.once("expire", key, "x")
    assert [r.getMessage() for r in caplog.records][:3] == ["expire 1: a", "expire 1: b", "expire 1: a"]
    assert len(rep._seen) == 2


# --- store-only batches ------------------------------------------------------------

POISON_SQL = {
    "sqlite": [
        "CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments WHEN OLD.task_id LIKE 'poison%'"
        " BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
    ],
    "postgresql": [
        "CREATE OR REPLACE FUNCTION poison() RETURNS trigger AS $$ BEGIN"
        " IF OLD.task_id LIKE 'poison%' THEN RAISE EXCEPTION 'poisoned row'; END IF;"
        " RETURN NEW; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments FOR EACH ROW EXECUTE FUNCTION poison()",
    ],
}


# The same poison in the statement after the transition: the expired row's audit event
# (only that one, so the failure is still recorded on the row).
POISON_EVENT_SQL = {
    "sqlite": [
        "CREATE TRIGGER poison BEFORE INSERT ON audit_events WHEN NEW.kind = 'expiry'"
        " AND (SELECT task_id FROM assignments WHERE id = NEW.row_id) LIKE 'poison%'"
        " BEGIN SELECT RAISE(ABORT, 'poisoned row'); END"
    ],
    "postgresql": [
        "CREATE OR REPLACE FUNCTION poison() RETURNS trigger AS $$ BEGIN"
        " IF NEW.kind = 'expiry' AND (SELECT task_id FROM assignments WHERE id = NEW.row_id) LIKE 'poison%'"
        " THEN RAISE EXCEPTION 'poisoned row'; END IF; RETURN NEW; END $$ LANGUAGE plpgsql",
        "CREATE TRIGGER poison BEFORE INSERT ON audit_events FOR EACH ROW EXECUTE FUNCTION poison()",
    ],
}


@pytest.mark.parametrize(
    ("poison", "table"), [(POISON_SQL, "assignments"), (POISON_EVENT_SQL, "audit_events")]
)
def test_a_store_only_batch_splits_around_its_poisoned_rows(
    plane: Plane, make_row: Any, poison: dict[str, list[str]], table: str
) -> None:
    """One set statement for the batch; where it fails, in parts, until the poisoned rows stand alone.

    Whichever of the pass's statements fails (the transition or its audit event), the
    poisoned row is left exactly as it was: no half of its transition commits.
    """
    poisoned = {3, 4, 11}
    names = [f"{'poison' if i in poisoned else 'ok'}{i}" for i in range(16)]
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=t, lease_until=1.0) for i, t in enumerate(names)]
    rows.append(make_row(RowState.ASSIGNED, ordinal=16))  # not running: lost its race
    with plane.store.session() as s:
        dialect = s.get_bind().dialect.name
        for sql in poison[dialect]:
            s.execute(text(sql))
    try:
        outcomes = runner.run_batch(plane, "expire", rows, NOW).outcomes
    finally:
        with plane.store.session() as s:
            on_table = "" if dialect == "sqlite" else f" ON {table}"
            s.execute(text(f"DROP TRIGGER IF EXISTS poison{on_table}"))
    assert outcomes == {"reoffered": 13, "failed": 3, "lost_race": 1}
    for i, row in enumerate(rows[:16]):
        got = row_state(plane.store, row)
        with plane.store.session(readonly=True) as s:
            kinds = [e["kind"] for e in audit.history(s, row)]
        if i in poisoned:
            assert (got["state"], got["failures"]) == ("running", 1) and "poisoned row" in got["last_error"]
            assert "expiry" not in kinds
        else:
            assert (got["state"], got["attempt"], got["failures"]) == ("assigned", 2, 0)
            assert kinds.count("expiry") == 1


@given(
    n=st.integers(min_value=0, max_value=300),
    poisoned=st.sets(st.integers(min_value=0, max_value=299), max_size=40),
)
@budget(200)
def test_isolate_finds_exactly_the_failing_keys_and_does_every_other_once(n: int, poisoned: set[int]) -> None:
    keys = list(range(n))
    bad = {k for k in poisoned if k < n}
    done: list[int] = []

    def attempt(part: Sequence[int]) -> list[int]:
        if bad & set(part):
            raise ValueError(f"poisoned {sorted(bad & set(part))}")
        done.extend(part)
        return list(part)

    results, failed = isolate(keys, attempt, goes_up=lambda err: False)

    assert [k for k, _ in failed] == sorted(bad)
    assert all(str(k) in str(err) for k, err in failed)
    assert [k for part in results for k in part] == [k for k in keys if k not in bad]
    assert done == [k for k in keys if k not in bad]  # each healthy key's work done once, in order


def test_isolate_stops_at_an_error_that_goes_up() -> None:
    def attempt(part: Sequence[int]) -> None:
        raise TransientError("store busy") if len(part) < 4 else ValueError("split me")

    with pytest.raises(TransientError, match="store busy"):
        isolate(list(range(64)), attempt, goes_up=lambda err: isinstance(err, TransientError))


def test_a_scattered_poison_is_refused_row_by_row_and_the_rest_expire_with_one_event_each(
    store: PoolStore, make_row: Any
) -> None:
    poisoned = set(range(5, 200, 13))
    rows = [
        make_row(
            RowState.RUNNING, ordinal=i, task_id=f"{'poison' if i in poisoned else 'ok'}{i}", lease_until=1.0
        )
        for i in range(200)
    ]
    with store.session() as s:
        dialect = s.get_bind().dialect.name
        for sql in POISON_SQL[dialect]:
            s.execute(text(sql))
    try:
        with store.session() as s:
            got = transitions.expire_many(s, rows, max_attempts=3, now=NOW, actor="pass:expire")
    finally:
        with store.session() as s:
            s.execute(
                text("DROP TRIGGER IF EXISTS poison" + ("" if dialect == "sqlite" else " ON assignments"))
            )
    bad = {rows[i] for i in poisoned}
    assert set(got.refused) == bad and all("poisoned row" in str(err) for err in got.refused.values())
    assert set(got.moved) == set(rows) - bad
    with store.session(readonly=True) as s:
        for row in rows:
            kinds = [e["kind"] for e in audit.history(s, row)]
            assert kinds.count("expiry") == (row not in bad)
            assert row_state(store, row)["state"] == ("running" if row in bad else "assigned")


def test_a_row_that_rolls_back_the_whole_transaction_leaves_the_batch_unchanged_and_transient(
    plane: Plane, make_row: Any
) -> None:
    """SQLite's RAISE(ROLLBACK) ends the transaction, savepoints and all: no part may go on
    without it (it would commit on its own), so the whole batch comes back transient."""
    if plane.store.engine.dialect.name != "sqlite":
        pytest.skip("only SQLite lets a statement end the transaction it runs in")
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=f"ok{i}", lease_until=1.0) for i in range(8)]
    rows.append(make_row(RowState.RUNNING, ordinal=8, task_id="poison8", lease_until=1.0))
    with plane.store.session() as s:
        s.execute(
            text(
                "CREATE TRIGGER poison BEFORE UPDATE OF state ON assignments WHEN OLD.task_id LIKE 'poison%'"
                " BEGIN SELECT RAISE(ROLLBACK, 'poisoned row'); END"
            )
        )
    result = runner.run_batch(plane, "expire", rows, NOW)

    assert [k for k, _ in result.transient] == rows and not result.done
    assert all("rolled the transaction back" in str(err) for _, err in result.transient)
    assert {row_state(plane.store, row)["state"] for row in rows} == {"running"}
    with plane.store.session(readonly=True) as s:
        assert not [e for row in rows for e in audit.history(s, row) if e["kind"] == "expiry"]


def test_rows_of_a_batch_failing_alike_share_one_line_naming_the_database_error(
    plane: Plane, make_row: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=f"poison{i}", lease_until=1.0) for i in range(25)]
    with plane.store.session() as s:
        dialect = s.get_bind().dialect.name
        for sql in POISON_SQL[dialect]:
            s.execute(text(sql))
    caplog.set_level(logging.INFO, "poolkeeper")
    try:
        assert runner.run_batch(plane, "expire", rows, NOW).outcomes == {"failed": 25}
    finally:
        with plane.store.session() as s:
            s.execute(
                text("DROP TRIGGER IF EXISTS poison" + ("" if dialect == "sqlite" else " ON assignments"))
            )
    assert not [r for r in caplog.records if r.getMessage().endswith(": failed")]  # no line per row besides
    lines = [r.getMessage() for r in caplog.records if "failed (1 in a row)" in r.getMessage()]
    shown = ", ".join(map(str, rows[:20]))
    assert len(lines) == 1 and lines[0].startswith(f"expire rows {shown} and 5 more failed (1 in a row): ")
    assert "poisoned row" in lines[0] and "[SQL:" not in lines[0]
    error = row_state(plane.store, rows[0])["last_error"]
    assert "poisoned row" in error and "[SQL:" not in error and "sqlalche.me" not in error


@pytest.mark.parametrize("size", [1, 5])
def test_the_time_limit_during_a_batch_statement_ends_the_batch_and_is_no_rows_failure(
    plane: Plane, make_row: Any, monkeypatch: pytest.MonkeyPatch, size: int
) -> None:
    """Only the database refusing a row is that row's failure: the worker's time limit going
    off mid-statement is no row's fault, and goes up to end the message."""
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=f"ok{i}", lease_until=1.0) for i in range(size)]
    for name in ("raw", "raw_alone"):  # a statement alone, or under its own savepoint
        real = getattr(db, name)

        def raw(conn: Any, sql: str, params: Any, real: Any = real) -> list[Any]:
            if "UPDATE assignments" in sql:  # on PostgreSQL, inside the statement that logs it
                raise SoftTimeLimitExceeded()
            return real(conn, sql, params)  # type: ignore[no-any-return]

        monkeypatch.setattr(db, name, raw)
    with pytest.raises(SoftTimeLimitExceeded):
        runner.run_batch(plane, "expire", rows, NOW, abort=(SoftTimeLimitExceeded,))
    monkeypatch.undo()
    for row in rows:
        got = row_state(plane.store, row)
        assert (got["state"], got["failures"], got["last_error"]) == ("running", 0, None)


def test_a_busy_store_is_asked_once_for_a_batch_of_failures_not_once_per_row(
    plane: Plane, make_row: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    rows = [make_row(RowState.RUNNING, ordinal=i, task_id=f"t{i}", lease_until=1.0) for i in range(3)]
    tries: list[list[int]] = []

    def busy(conn: Any, errors: dict[int, str], **_: Any) -> None:
        tries.append(sorted(errors))
        raise TransientError("pool store: database is locked")

    monkeypatch.setattr(bookkeeping, "record_failures", busy)
    caplog.set_level(logging.INFO, "poolkeeper")
    got = failures.record(
        plane, registry.get("expire"), [(r, ValueError("x")) for r in rows], NOW, counts=True
    )

    assert got == ["failed"] * 3 and tries == [sorted(rows)]
    lines = [r.getMessage() for r in caplog.records if "unrecorded" in r.getMessage()]
    assert lines == [
        f"expire rows {', '.join(map(str, rows))} failed (unrecorded: pool store: database is locked)"
        ": ValueError: x"
    ]


def test_a_batch_whose_locks_cannot_be_taken_is_settled_as_transient(
    plane: Plane, monkeypatch: pytest.MonkeyPatch
) -> None:
    def away(_: list[str]) -> list[str | None]:
        raise TransientError("redis: busy")

    monkeypatch.setattr(plane.coord, "lock_many", away)
    settled: list[list[Any]] = []

    def settle(result: runner.BatchResult) -> list[Any]:
        settled.append([key for key, _ in result.transient])
        return []

    result = runner.run_batch(plane, "expire", [1, 2], NOW, settle=settle)
    assert settled == [[1, 2]], "the task retries what its settle is told is transient"
    assert [key for key, _ in result.transient] == [1, 2] and result.done == []

"""gc: terminal rows, delivery records and audit events past the retention go, in bounded batches.

Given rows one unit either side of the cutoff (``now - retention_seconds``: strictly older
goes), rows in every non-terminal state however old, and a batch size smaller than the
garbage; when gc runs; then exactly the old terminal rows (and their children), the old
deliveries and the old events are gone, no statement deleted more than a batch, and the
others are untouched.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from sqlalchemy import func, select

from store import PoolStore, audit, transitions
from store.models import Assignment, Delivery, EventKind, RowState
from tasks import gc, runner
from tasks.plane import Plane
from tests.factories import NOW, RowFactory

EXPIRE = audit.by_pass("expire")
TERMINAL = (RowState.FINALIZED, RowState.STALE)


def trail(store: PoolStore, row_id: int) -> list[dict[str, object]]:
    with store.session(readonly=True) as s:
        return audit.history(s, row_id)


def states(store: PoolStore) -> dict[int, str]:
    with store.session(readonly=True) as s:
        return {row_id: state for row_id, state in s.execute(select(Assignment.id, Assignment.state))}


def deliveries(store: PoolStore) -> set[str]:
    with store.session(readonly=True) as s:
        return set(s.scalars(select(Delivery.delivery_id)))


def delivered(
    store: PoolStore, delivery_id: str, at: float, row_id: int = 1, kind: str = "heartbeat"
) -> None:
    with store.session() as s:
        s.add(
            Delivery(delivery_id=delivery_id, assignment_id=row_id, kind=kind, digest="0" * 64, created_at=at)
        )


def test_gc_deletes_terminal_rows_one_unit_past_the_retention_and_keeps_one_unit_inside(
    plane: Plane, make_row: RowFactory
) -> None:
    # Given finalized and stale rows one second either side of the cutoff
    retention = plane.settings.retention_seconds
    now = NOW + 2 * retention
    old = [make_row(state, ordinal=i, updated_at=now - retention - 1) for i, state in enumerate(TERMINAL)]
    young = [make_row(state, ordinal=i, updated_at=now - retention + 1) for i, state in enumerate(TERMINAL)]
    at_cutoff = make_row(RowState.FINALIZED, updated_at=now - retention)
    # When gc runs
    assert gc.collect(plane, now) == gc.Collected(rows=len(old))
    # Then the older are gone, the younger (and the one exactly at the cutoff) stay
    left = states(plane.store)
    assert not set(old) & set(left) and set(young) | {at_cutoff} <= set(left)


@pytest.mark.parametrize(
    "state", [RowState.ASSIGNED, RowState.RUNNING, RowState.RESULT, RowState.LEASE_FAILED]
)
def test_gc_never_touches_a_row_that_is_not_finalized_or_stale(
    plane: Plane, make_row: RowFactory, state: RowState
) -> None:
    retention = plane.settings.retention_seconds
    now = NOW + 100 * retention
    row = make_row(state, lease_until=NOW - retention, updated_at=NOW - retention)  # ancient
    assert runner.run_key(plane, "gc", "all", now) == "nothing"
    assert states(plane.store) == {row: state.value}


def test_gc_deletes_delivery_records_one_unit_past_the_retention(plane: Plane) -> None:
    retention = plane.settings.retention_seconds
    now = NOW + 2 * retention
    delivered(plane.store, "old", now - retention - 1)
    delivered(plane.store, "young", now - retention + 1)
    assert gc.collect(plane, now) == gc.Collected(deliveries=1)
    assert deliveries(plane.store) == {"young"}


@pytest.mark.parametrize(
    "state", [RowState.ASSIGNED, RowState.RUNNING, RowState.RESULT, RowState.LEASE_FAILED]
)
def test_a_row_not_yet_settled_keeps_its_delivery_records_however_old(
    plane: Plane, make_row: RowFactory, state: RowState
) -> None:
    """A run held past the retention (a board away for a week) still answers a replay of its result
    or release as a duplicate."""
    retention = plane.settings.retention_seconds
    now = NOW + 2 * retention
    live = make_row(state, ordinal=0, updated_at=now - retention - 1)
    done = make_row(RowState.FINALIZED, ordinal=1, updated_at=now)  # terminal but young: its records may go
    for kind in ("result", "release", "heartbeat"):
        delivered(plane.store, f"live's {kind}", now - retention - 1, row_id=live, kind=kind)
        delivered(plane.store, f"done's {kind}", now - retention - 1, row_id=done, kind=kind)
    assert gc.collect(plane, now) == gc.Collected(deliveries=4)  # a heartbeat's replay is not a week late
    assert deliveries(plane.store) == {"live's result", "live's release"}


def test_each_gc_statement_deletes_one_batch_at_most(plane: Plane, make_row: RowFactory) -> None:
    # Given more old rows and deliveries than a batch
    retention = plane.settings.retention_seconds
    now = NOW + 2 * retention
    rows = [make_row(RowState.FINALIZED, ordinal=i % 3, updated_at=now - retention - 1) for i in range(7)]
    for i in range(5):
        delivered(plane.store, f"d{i}", now - retention - 1)
    # When one batch of 3 is collected, it deletes 3 of each, and the sweep deletes the rest
    with plane.store.session() as s:
        assert transitions.collect_garbage(s, retention_seconds=retention, batch=3, now=now) == (3, 3)
    with plane.store.session(readonly=True) as s:
        assert s.scalar(select(func.count()).select_from(Assignment)) == len(rows) - 3
    plane.settings = dataclasses.replace(plane.settings, gc_batch=3)
    assert gc.collect(plane, now) == gc.Collected(rows=4, deliveries=2)
    assert states(plane.store) == {} and deliveries(plane.store) == set()


def test_gc_collects_only_events_past_the_retention_in_batches(plane: Plane, store: PoolStore) -> None:
    retention = plane.settings.retention_seconds
    now = NOW + 2 * retention
    old = [
        audit.Event(1, EventKind.FAILURE, EXPIRE, "running", "running", 1, 1, f"old {i}") for i in range(7)
    ]
    kept = audit.Event(1, EventKind.FAILURE, EXPIRE, "running", "running", 1, 1, "kept")
    with store.session() as s:
        audit.append(s, old, now=now - retention - 1)
        audit.append(s, [kept], now=now - retention + 1)
    plane.settings = dataclasses.replace(plane.settings, gc_batch=3)
    assert gc.collect(plane, now) == gc.Collected(events=7)
    assert [e["detail"] for e in trail(store, 1)] == ["kept"]
    assert runner.run_key(plane, "gc", "all", now) == "nothing"


def test_gc_sweeps_until_caught_up_and_says_when_its_budget_ends_first(
    plane: Plane, store: PoolStore, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rate is the database's: a sweep is not capped at a count of batches (20 once), so a
    pool that writes more in an interval than the cap would delete does not grow without end;
    a sweep that runs out of time says it is behind, and the next one goes on."""
    retention = plane.settings.retention_seconds
    now = NOW + 2 * retention
    old = [audit.Event(1, EventKind.FAILURE, EXPIRE, "running", "running", 1, 1, f"{i}") for i in range(100)]
    with store.session() as s:
        audit.append(s, old, now=now - retention - 1)
        audit.append(s, old[:1], now=now)  # kept: not old yet
    plane.settings = dataclasses.replace(plane.settings, gc_batch=1)

    with monkeypatch.context() as m, caplog.at_level(logging.INFO, logger="poolkeeper.maintenance"):
        m.setattr(gc, "allowed_seconds", lambda _plane: 0.0)  # the budget ends after one batch
        assert runner.run_key(plane, "gc", "all", now) == "collected"
    (line,) = [r for r in caplog.records if r.getMessage().startswith("gc:")]
    assert line.levelno == logging.WARNING and "behind" in line.getMessage(), line.getMessage()

    ticks = iter(range(100))  # each batch takes a third of the budget: the third ends the sweep
    clock = lambda: next(ticks) * gc.allowed_seconds(plane) / 3  # noqa: E731
    assert gc.collect(plane, now, clock=clock) == gc.Collected(events=3, behind=True)
    assert gc.collect(plane, now) == gc.Collected(events=96)  # 96 batches: more than any fixed cap
    assert len(trail(store, 1)) == 1

"""Expire: an ended lease is re-offered until the last attempt, then ``lease_failed``; a live one is left."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from sqlalchemy import update

from board import Board
from store import transitions
from store.models import Assignment, RowState
from tasks import registry, runner
from tasks.declaration import SUSPECTS_PER_BATCH
from tasks.plane import Plane
from tests.factories import NOW, OWNER, RowFactory, row_state, running_row


def test_expire_reoffers_then_fails_after_the_last_attempt(plane: Plane, kanban: Board) -> None:
    row = running_row(plane, kanban)
    t = NOW
    for attempt in range(1, plane.settings.max_attempts + 1):
        t += plane.settings.lease_seconds + 1
        expected = "reoffered" if attempt < plane.settings.max_attempts else "lease_failed"
        assert runner.run_key(plane, "expire", row, t) == expected
        if expected == "reoffered":
            assert plane.store.offer(row_state(plane.store, row)["ordinal"], owner=OWNER, now=t) is not None
    got = row_state(plane.store, row)
    assert got["state"] == "lease_failed" and got["attempt"] == plane.settings.max_attempts


def test_expire_leaves_a_live_lease_alone(plane: Plane, kanban: Board) -> None:
    row = running_row(plane, kanban)
    lease_until = row_state(plane.store, row)["lease_until"]
    assert runner.run_key(plane, "expire", row, lease_until) == "lost_race"
    assert row_state(plane.store, row)["state"] == "running"


def test_the_expire_scanner_finds_every_due_row_while_workers_finish_earlier_pages(
    plane: Plane, make_row: RowFactory
) -> None:
    rows = [make_row(RowState.RUNNING, ordinal=i, lease_until=NOW - 10 + i) for i in range(7)]
    paged = replace(plane, settings=replace(plane.settings, scan_limit=2))
    submitted: list[int] = []

    def done_at_once(pass_name: str, keys: Sequence[int]) -> list[int]:  # before the next page is read
        submitted.extend(keys)
        with plane.store.session() as s:
            transitions.expire_many(s, keys, max_attempts=plane.settings.max_attempts, now=NOW)
        return list(keys)

    assert registry.get("expire").find(paged, NOW, done_at_once) == 7
    assert submitted == rows  # oldest lease first, none skipped, none twice


def recorder() -> tuple[list[list[int]], Callable[[str, Sequence[int]], list[int]]]:
    """A submit that enqueues everything: the messages it was given, in order."""
    messages: list[list[int]] = []

    def record(pass_name: str, keys: Sequence[int]) -> list[int]:
        messages.append(list(keys))
        return list(keys)

    return messages, record


def test_the_expire_scanner_batches_rows_with_a_failure_streak_apart(
    plane: Plane, make_row: RowFactory
) -> None:
    rows = [make_row(RowState.RUNNING, ordinal=i, lease_until=NOW - 100 + i) for i in range(40)]
    suspects = rows[3::2][: SUSPECTS_PER_BATCH + 2]  # more than one message of them
    with plane.store.session() as s:
        s.execute(update(Assignment).where(Assignment.id.in_(suspects)).values(failures=1))
    messages, record = recorder()
    assert registry.get("expire").find(plane, NOW, record) == len(rows)
    clean = [r for r in rows if r not in suspects]
    assert messages == [clean, suspects[:SUSPECTS_PER_BATCH], suspects[SUSPECTS_PER_BATCH:]]


def test_the_expire_scanner_queues_suspects_behind_every_clean_page(
    plane: Plane, make_row: RowFactory
) -> None:
    rows = [make_row(RowState.RUNNING, ordinal=i, lease_until=NOW - 100 + i) for i in range(12)]
    suspects = [rows[1], rows[6]]  # one on the first page, one on the second
    with plane.store.session() as s:
        s.execute(update(Assignment).where(Assignment.id.in_(suspects)).values(failures=1))
    paged = replace(plane, settings=replace(plane.settings, scan_limit=5))
    messages, record = recorder()
    assert registry.get("expire").find(paged, NOW, record) == len(rows)
    clean = [r for r in rows if r not in suspects]
    assert messages == [clean[:4], clean[4:8], clean[8:], suspects]  # pages of 5, the suspects last

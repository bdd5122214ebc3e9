"""Materialize: a claim becomes a row, or is parked, deferred or dropped, never called twice."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from sqlalchemy import Engine, text

from board import Board, TaskStatus
from core.errors import CorruptRow
from store import queries
from store.models import RowState
from tasks import registry, runner
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tests.factories import NOW, OWNER, RowFactory, claimed, dispatched, row_state


@pytest.mark.parametrize(
    ("body", "lane", "outcome", "status", "kind"),
    [
        ("plain text", "pool", "added", TaskStatus.RUNNING, None),
        ('{"api_token": "s3cr3t"}', "pool", "parked", TaskStatus.BLOCKED, "capability"),
        ("{not json", "pool", "parked", TaskStatus.BLOCKED, "capability"),
        ("x" * 70_000, "pool", "parked", TaskStatus.BLOCKED, "capability"),
        ('{"a":' * 63 + "1" + "}" * 63, "pool", "added", TaskStatus.RUNNING, None),  # 64 with the payload
        ('{"a":' * 64 + "1" + "}" * 64, "pool", "parked", TaskStatus.BLOCKED, "capability"),
        ('{"a":' * 5000 + "1" + "}" * 5000, "pool", "parked", TaskStatus.BLOCKED, "capability"),
    ],
)
def test_materialize_parks_only_runs_that_cannot_be_served(
    plane: Plane,
    kanban: Board,
    engine_of: Callable[[Board], Engine],
    body: str,
    lane: str,
    outcome: str,
    status: TaskStatus,
    kind: str | None,
) -> None:
    kanban.add_task("b", "t", task_id="t", lane=lane)
    with engine_of(kanban).begin() as conn:  # another writer stores a body that add_task refuses
        conn.execute(text("UPDATE tasks SET body = :body WHERE id = 't'"), {"body": body})
    [claim] = dispatched(plane)
    assert runner.run_key(plane, "materialize", claim, NOW) == outcome
    task = kanban.get_task("b", "t")
    assert task is not None and task.status is status and task.block_kind == kind
    with plane.store.session() as s:
        assert sum(queries.counts_by_state(s).values()) == (1 if outcome == "added" else 0)


def test_materialize_of_a_vanished_moved_or_duplicate_claim_changes_nothing(
    plane: Plane, kanban: Board
) -> None:
    for t in ("gone", "moved", "dup"):
        kanban.add_task("b", t, task_id=t)
    claims = {c["task_id"]: c for c in dispatched(plane)}
    kanban.delete_task("b", "gone")
    kanban.reassign_task("b", "moved", assignee="alice", lane="humans")
    assert runner.run_key(plane, "materialize", claims["gone"], NOW) == "vanished"
    assert runner.run_key(plane, "materialize", claims["moved"], NOW) == "moved_on"
    assert runner.run_key(plane, "materialize", claims["dup"], NOW) == "added"
    assert runner.run_key(plane, "materialize", claims["dup"], NOW) == "duplicate"
    assert kanban.get_task("b", "moved").status is TaskStatus.RUNNING  # type: ignore[union-attr]


def test_materialize_never_calls_a_claim_whose_identity_already_ended_a_duplicate(
    plane: Plane, kanban: Board, make_row: RowFactory
) -> None:
    kanban.add_task("b", "x", task_id="t")
    [claim] = dispatched(plane)
    ended = make_row(
        RowState.FINALIZED, board="b", task_id="t", run_id=claim["run_id"], ordinal=claim["ordinal"]
    )
    assert runner.run_key(plane, "materialize", claim, NOW) == "deferred"
    assert kanban.get_task("b", "t").status is TaskStatus.RUNNING  # type: ignore[union-attr]
    with plane.store.session() as s:
        assert [r.id for r in queries.rows(s)] == [ended]


def test_materialize_on_a_taken_ordinal_is_deferred_without_touching_the_board(
    plane: Plane, kanban: Board
) -> None:
    [row] = claimed(plane, kanban)
    kanban.add_task("b", "late", task_id="late")
    [claim] = kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    taken = row_state(plane.store, row)["ordinal"]
    job = {"board": "b", "task_id": "late", "run_id": claim.run_id, "ordinal": taken}
    assert runner.run_key(plane, "materialize", job, NOW) == "deferred"
    assert kanban.get_task("b", "late").status is TaskStatus.RUNNING  # type: ignore[union-attr]


def test_a_claim_whose_lock_is_busy_gives_its_reservation_back_and_changes_nothing(
    plane: Plane, kanban: Board
) -> None:
    # Given a claim on its reserved ordinal whose lock another (dead or duplicate) holder has
    kanban.add_task("b", "t", task_id="t")
    [claim] = dispatched(plane)
    plane.coord.lock_many([registry.get("materialize").lock_name(claim)])
    # When its message runs: lock busy, and the ordinal is free for the next claim
    assert runner.run_key(plane, "materialize", claim, NOW) == "lock_busy"
    assert plane.coord.reserve([claim["ordinal"]]) == [claim["ordinal"]]
    with plane.store.session() as s:
        assert queries.rows(s) == []


def test_an_unreadable_row_is_seen_by_the_operator_and_freed_by_the_boards_word(
    plane: Plane, kanban: Board
) -> None:
    [row] = claimed(plane, kanban)
    with plane.store.session() as s:
        s.execute(text("UPDATE assignments SET payload = '{broken' WHERE id = :i"), {"i": row})
    with pytest.raises(CorruptRow, match=f"row {row}"):
        plane.store.offer(row_state(plane.store, row)["ordinal"], owner=OWNER, now=NOW)
    assert "payload" in row_state(plane.store, row)["last_error"]
    kanban.cancel_task("b", "b0")  # what an operator does with a run the pool cannot serve
    assert maintain_once(plane, NOW)["reconcile"] == {"stale": 1}
    assert row_state(plane.store, row)["state"] == "stale"
    with plane.store.session() as s:
        assert queries.free_ordinals(s, plane.settings.pool_size) == [0, 1, 2]

"""Materialize: a claim becomes a row, or is parked, deferred or dropped, never called twice."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import Engine, text

from board import Board, FlakyBoard, TaskStatus
from core.errors import CorruptRow, TransientError
from store import queries
from store.models import RowState
from tasks import failures, registry, runner
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tests.factories import (
    NOW,
    OWNER,
    RowFactory,
    claim_on_a_taken_ordinal,
    claimed,
    dispatched,
    row_state,
    scanned,
)


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


def test_materialize_on_a_taken_ordinal_takes_another_free_one(plane: Plane, kanban: Board) -> None:
    # Given a claim whose reservation was lost (Redis restarted) and whose ordinal a row now holds
    [row] = claimed(plane, kanban)
    kanban.add_task("b", "late", task_id="late")
    [claim] = kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    taken = row_state(plane.store, row)["ordinal"]
    job = {"board": "b", "task_id": "late", "run_id": claim.run_id, "ordinal": taken}
    # When it runs: its row is added on another free ordinal at once, not left to reconcile
    assert runner.run_key(plane, "materialize", job, NOW) == "added"
    with plane.store.session() as s:
        ordinals = sorted(r.ordinal for r in queries.rows(s))
    assert len(set(ordinals)) == 2 and taken in ordinals
    assert plane.coord.reserve(range(3)) == [0, 1, 2], "the other ordinal's reservation was released"


def test_materialize_on_a_taken_ordinal_with_none_free_waits_for_the_next_without_touching_the_board(
    plane: Plane, kanban: Board
) -> None:
    # Given every ordinal busy, and a claim for ordinal 0 whose reservation is gone (Redis restarted)
    job = claim_on_a_taken_ordinal(plane, kanban, "late")
    taken = job["ordinal"]
    # When it finds its ordinal held and none free, Then it waits, holding no ordinal
    assert runner.run_key(plane, "materialize", job, NOW) == "waits"
    assert plane.coord.reserve([taken]) == [taken], "nothing reserved on a busy ordinal"
    assert kanban.get_task("b", "late").status is TaskStatus.RUNNING  # type: ignore[union-attr]
    assert [c["task_id"] for c in waiting(plane)] == ["late"]


def waiting(plane: Plane) -> list[dict[str, object]]:
    return [json.loads(c) for c in plane.coord.take_waiting(100)]


def test_a_waiting_claim_gets_the_first_ordinal_that_frees_before_any_new_claim(
    plane: Plane, kanban: Board
) -> None:
    # Given every ordinal busy, a claim of ordinal 0 waiting for one, and a new task ready
    job = claim_on_a_taken_ordinal(plane, kanban, "late")
    first = job["ordinal"]
    assert runner.run_key(plane, "materialize", job, NOW) == "waits"
    kanban.add_task("b", "new", task_id="new")
    # When another ordinal's row ends (not its own)
    with plane.store.session() as s:
        [busy] = [r for r in queries.rows(s) if r.ordinal != first][:1]
    kanban.reassign_task("b", busy.task_id, assignee="alice", lane="humans")
    assert runner.run_key(plane, "reconcile", busy.id, NOW) == "stale"
    # Then dispatch hands that ordinal to the waiting claim, and claims nothing new
    [served] = dispatched(plane)
    assert (served["task_id"], served["ordinal"]) == ("late", busy.ordinal)
    assert runner.run_key(plane, "materialize", served, NOW) == "added"
    assert kanban.get_task("b", "new").status is TaskStatus.READY  # type: ignore[union-attr]
    assert waiting(plane) == []


def test_an_orphan_with_no_ordinal_free_waits_and_new_claims_never_starve_it(
    plane: Plane, kanban: Board
) -> None:
    # Given every ordinal busy and a claimed run with no row (its message was lost)
    claimed(plane, kanban, n=3)
    kanban.add_task("b", "orphan", task_id="orphan")
    kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    kanban.add_task("b", "new", task_id="new")
    # When reconcile finds it: it waits for an ordinal (no message yet, nothing reserved)
    assert scanned(plane, "reconcile").get("materialize", []) == []
    # and a row ends: dispatch hands that ordinal to the orphan, not to the new task
    with plane.store.session() as s:
        busy = queries.rows(s)[0]
    kanban.reassign_task("b", busy.task_id, assignee="alice", lane="humans")
    assert runner.run_key(plane, "reconcile", busy.id, NOW) == "stale"
    [orphan] = dispatched(plane)
    assert orphan["task_id"] == "orphan" and orphan["ordinal"] == busy.ordinal
    assert "seen" not in orphan, "served on the board's word then, not reconcile's old snapshot"
    # Then it gets its row there
    assert runner.run_key(plane, "materialize", orphan, NOW) == "added"
    assert kanban.get_task("b", "new").status is TaskStatus.READY  # type: ignore[union-attr]


def test_a_claim_retried_after_a_busy_board_keeps_its_ordinal_and_gets_its_row(
    plane: Plane, kanban: Board
) -> None:
    # Given a claim whose materialize met a busy board (a transient failure: it is retried)
    kanban.add_task("b", "first", task_id="first")
    [claim] = dispatched(plane)
    healthy, plane.board = plane.board, FlakyBoard(kanban, busy_rate=0.999999)
    with pytest.raises(TransientError):
        runner.run_key(plane, "materialize", claim, NOW)
    plane.board = healthy
    # When dispatch claims for the free ordinals meanwhile, and those claims get their rows
    for i in range(3):
        kanban.add_task("b", f"t{i}", task_id=f"t{i}")
    others = dispatched(plane)
    assert claim["ordinal"] not in {c["ordinal"] for c in others}, "its ordinal is still promised to it"
    assert len(others) == 2
    for c in others:
        assert runner.run_key(plane, "materialize", c, NOW) == "added"
    # Then its retry gets its row on its own ordinal, not deferred to the next reconcile
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session() as s:
        assert sorted(r.ordinal for r in queries.rows(s)) == [0, 1, 2]


def test_a_claim_whose_retries_ran_out_gives_its_ordinal_back(plane: Plane, kanban: Board) -> None:
    kanban.add_task("b", "t", task_id="t")
    [claim] = dispatched(plane)
    plane.board = FlakyBoard(kanban, busy_rate=0.999999)
    p = registry.get("materialize")
    try:
        runner.run_key(plane, "materialize", claim, NOW)
    except TransientError as err:
        failures.give_up(plane, p, claim, err, NOW)
    assert plane.coord.reserve([claim["ordinal"]]) == [claim["ordinal"]], "reconcile may hand it over"


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


def test_a_claimed_row_keeps_when_its_task_turned_ready_and_its_wait_is_observed_once(
    plane: Plane, kanban: Board, engine_of: Callable[[Board], Engine]
) -> None:
    """Given a task the board says turned ready 42 s before the claim is materialized; the row keeps
    ``ready_at`` and ``poolkeeper_task_wait_seconds`` counts 42 s once (a replayed claim: not again)."""
    kanban.add_task("b", "t", task_id="t")
    with engine_of(kanban).begin() as conn:
        conn.execute(text("UPDATE tasks SET ready_at = :at WHERE id = 't'"), {"at": NOW - 42})
    before = waits()
    [claim] = dispatched(plane)
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    assert runner.run_key(plane, "materialize", claim, NOW + 1) == "duplicate"
    with plane.store.session(readonly=True) as s:
        [row] = queries.rows(s)
    assert row.ready_at == NOW - 42
    count, total = waits()
    assert (count - before[0], total - before[1]) == (1, 42)


def waits() -> tuple[float, float]:
    """``poolkeeper_task_wait_seconds``' count and sum in this process."""
    get = REGISTRY.get_sample_value
    return get("poolkeeper_task_wait_seconds_count") or 0.0, get("poolkeeper_task_wait_seconds_sum") or 0.0

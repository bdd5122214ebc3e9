"""Reconcile: moved runs made stale, orphans handed to materialize, one failing board stops no other."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Engine, text

from board import Board, FlakyBoard
from core.errors import TransientError
from store import queries
from store.models import RowState
from tasks import runner
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tests.factories import (
    NOW,
    claimed,
    deliver,
    dispatched,
    lease_failed_row,
    row_state,
    running_row,
    scanned,
)


def test_reconcile_hands_moved_runs_to_itself_and_orphans_to_materialize(plane: Plane, kanban: Board) -> None:
    [row] = claimed(plane, kanban)
    kanban.reassign_task("b", "b0", assignee="alice", lane="humans")
    kanban.add_task("b", "orphan", task_id="orphan")
    kanban.add_task("b", "human", task_id="human", lane="humans")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")  # claimed; the materialize never came
    kanban.claim_ready(5, assignee="poolkeeper", lane="humans")  # not the pool's lane: never adopted
    queued = scanned(plane, "reconcile")
    assert queued["reconcile"] == [row]
    [claim] = queued["materialize"]
    assert (claim["task_id"], claim["run_id"]) == ("orphan", 1)
    assert runner.run_key(plane, "reconcile", row, NOW) == "stale"
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    assert row_state(plane.store, row)["state"] == "stale"
    with plane.store.session() as s:
        live = [(r.task_id, r.attempt) for r in queries.rows(s, state=RowState.ASSIGNED)]
    assert live == [("orphan", 1)]
    assert scanned(plane, "reconcile") == {}


@pytest.mark.parametrize("meanwhile", ["cancelled", "claimed again in a new run"])
def test_an_orphans_claim_delivered_late_reads_the_board_afresh(
    plane: Plane, kanban: Board, meanwhile: str
) -> None:
    # Given an orphan handed to materialize, whose message is delayed (a backlog, a retry)
    kanban.add_task("b", "orphan", task_id="orphan")
    kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    [late] = scanned(plane, "reconcile")["materialize"]
    # When the run moves on before the message is served
    if meanwhile == "cancelled":
        kanban.cancel_task("b", "orphan")
    else:
        kanban.reassign_task("b", "orphan", assignee="poolkeeper", lane="pool")  # run 2 starts
        [fresh] = scanned(plane, "reconcile")["materialize"]
        assert runner.run_key(plane, "materialize", fresh, NOW) == "added"
    # Then the late claim adds no row: at most one live row per task, none for an ended run
    assert runner.run_key(plane, "materialize", late, NOW) == "moved_on"
    with plane.store.session() as s:
        live = [(r.task_id, r.run_id) for r in queries.rows(s, state=RowState.ASSIGNED)]
    assert live == ([] if meanwhile == "cancelled" else [("orphan", 2)])


def test_reconcile_leaves_a_row_whose_run_the_board_still_runs(plane: Plane, kanban: Board) -> None:
    [row] = claimed(plane, kanban)
    assert runner.run_key(plane, "reconcile", row, NOW) == "current"
    assert row_state(plane.store, row)["state"] == "assigned"


def test_reconcile_never_adopts_a_run_that_has_a_row_in_any_state(plane: Plane, kanban: Board) -> None:
    row = lease_failed_row(plane, kanban)
    assert scanned(plane, "reconcile") == {}
    assert row_state(plane.store, row)["state"] == "lease_failed"


def test_an_orphan_the_board_cannot_read_alone_still_gets_a_row(plane: Plane, kanban: Board) -> None:
    """Reconcile's claim carries the task as the board listed it: a row stands for the run."""
    kanban.add_task("b", "x", task_id="bad")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")
    plane.board = FlakyBoard(kanban, poison=frozenset({"bad"}))
    [claim] = scanned(plane, "reconcile")["materialize"]
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session() as s:
        assert [(r.task_id, r.state) for r in queries.rows(s)] == [("bad", "assigned")]


def test_a_claim_the_board_cannot_read_alone_gets_its_row_at_once(plane: Plane, kanban: Board) -> None:
    """Not a reconcile interval later: the board's listing is the evidence reconcile would use."""
    kanban.add_task("b", "x", task_id="bad")
    [claim] = dispatched(plane)
    plane.board = FlakyBoard(kanban, poison=frozenset({"bad"}))
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session() as s:
        assert [(r.task_id, r.ordinal, r.state) for r in queries.rows(s)] == [
            ("bad", claim["ordinal"], "assigned")
        ]


def test_reconcile_adopts_orphans_of_archived_boards(plane: Plane, kanban: Board) -> None:
    kanban.add_task("old", "x", task_id="x")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")
    kanban.archive_board("old")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 1}


def test_one_failing_board_does_not_stop_the_next(
    plane: Plane, kanban: Board, caplog: pytest.LogCaptureFixture
) -> None:
    kanban.add_task("bad", "x", task_id="x")
    kanban.add_task("good", "y", task_id="y")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")

    class OneBoardDown(FlakyBoard):
        def running_tasks(self, board: str) -> Any:
            if board == "bad":
                raise RuntimeError("bad board's index is corrupt")
            return super().running_tasks(board)

    plane.board = OneBoardDown(kanban)
    caplog.set_level(logging.WARNING, "poolkeeper")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 1}
    maintain_once(plane, NOW)
    reports = [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(reports) == 1 and reports[0].levelno == logging.ERROR, "reported once, as a bug"


def test_a_task_deleted_and_added_again_gets_new_run_ids_and_wedges_nothing(
    plane: Plane, kanban: Board
) -> None:
    row = running_row(plane, kanban)
    deliver(plane, row, {"status": "done"})
    assert maintain_once(plane, NOW)["results"] == {"finalized": 1}
    kanban.delete_task("b", "b0")
    kanban.add_task("b", "same id again", task_id="b0")
    kanban.add_task("b", "a neighbour", task_id="n")
    assert maintain_once(plane, NOW)["materialize"] == {"added": 2}
    with plane.store.session() as s:
        got = sorted((r.task_id, r.run_id, r.state) for r in queries.rows(s))
    assert got == [("b0", 1, "finalized"), ("b0", 2, "assigned"), ("n", 1, "assigned")]


def test_a_corrupt_result_on_one_task_never_hides_an_orphan_of_its_board(
    plane: Plane, kanban: Board, engine_of: Callable[[Board], Engine]
) -> None:
    kanban.add_task("b", "x", task_id="corrupt")
    kanban.add_task("b", "y", task_id="healthy")
    kanban.claim_ready(5, assignee="poolkeeper", lane="pool")  # claimed; the materialize never came
    with engine_of(kanban).begin() as conn:
        conn.execute(text("UPDATE tasks SET result = '{broken' WHERE id = 'corrupt'"))
    queued = scanned(plane, "reconcile")
    assert sorted(c["task_id"] for c in queued["materialize"]) == ["corrupt", "healthy"]
    for claim in queued["materialize"]:
        assert runner.run_key(plane, "materialize", claim, NOW) == "added"


def test_reconcile_releases_moved_on_rows_while_the_board_registry_fails(
    plane: Plane, kanban: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    kanban.add_task("b", "task", task_id="t1")
    [claim] = scanned(plane, "materialize")["materialize"]
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    kanban.reassign_task("b", "t1", assignee="alice", lane="humans")  # the run moved on

    def registry_down(**_: Any) -> list[str]:
        raise TransientError("board: registry busy")

    monkeypatch.setattr(plane.board, "list_boards", registry_down)
    queued = scanned(plane, "reconcile")
    assert queued["reconcile"] == [1]
    assert runner.run_key(plane, "reconcile", 1, NOW) == "stale"

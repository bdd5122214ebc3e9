"""Operator moves that reach board and pool: cancel fences the holder out at once."""

from __future__ import annotations

import pytest

from board import KanbanBoard, TaskStatus
from core.errors import StaleHolder, TransientError
from poolkeeper import operator
from store import Offer, PoolStore, queries, transitions
from store.models import RowState
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tests.factories import NOW, envelope, row_state


def given_running(store: PoolStore, kanban: KanbanBoard, task_id: str = "t1", ordinal: int = 0) -> Offer:
    """A task claimed from the board, its row on ``ordinal``, taken by that ordinal's worker."""
    kanban.add_task("b", f"task {task_id}", task_id=task_id)
    [claim] = kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    store.add_run(board="b", task_id=task_id, run_id=claim.run_id, ordinal=ordinal, payload={"t": 1}, now=NOW)
    offer = store.offer(ordinal, now=NOW)
    assert offer is not None
    return offer


# --- cancel ----------------------------------------------------------------------


def test_cancel_of_a_running_task_fences_its_worker_out_at_once(
    store: PoolStore, kanban: KanbanBoard, plane: Plane
) -> None:
    offer = given_running(store, kanban)
    got = operator.cancel(kanban, store, "b", "t1", NOW)
    assert got.settled is not None and (got.settled.row_id, got.settled.was) == (offer.row_id, "running")
    with pytest.raises(StaleHolder, match=f"state: stale holder refused: row {offer.row_id} is stale"):
        store.heartbeat(envelope(offer, "hb"), now=NOW + 1)
    with pytest.raises(StaleHolder):
        store.accept_result(envelope(offer, "res", payload={"status": "done"}), now=NOW + 1)
    assert store.offer(0, now=NOW + 1) is None, "the run is not offered again"
    maintain_once(plane, NOW + 2)  # the plane afterwards agrees: nothing to undo
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.DONE and task.result == {"cancelled": True}
    assert row_state(store, offer.row_id)["state"] == "stale"
    with store.session(readonly=True) as s:
        assert queries.free_ordinals(s, store.pool_size) == [0, 1, 2]


def test_cancel_of_a_task_with_no_live_row_changes_only_the_board(
    store: PoolStore, kanban: KanbanBoard
) -> None:
    kanban.add_task("b", "ready one", task_id="t1")
    got = operator.cancel(kanban, store, "b", "t1", NOW)
    assert got.settled is None and got.task.status is TaskStatus.DONE


def test_cancel_leaves_the_row_to_reconcile_when_the_store_is_busy(
    store: PoolStore, kanban: KanbanBoard, monkeypatch: pytest.MonkeyPatch
) -> None:
    offer = given_running(store, kanban)

    def busy(*_: object, **__: object) -> None:
        raise TransientError("pool store: database is locked")

    monkeypatch.setattr(transitions, "settle_run", busy)
    got = operator.cancel(kanban, store, "b", "t1", NOW)
    assert got.left_to_reconcile == "pool store: database is locked"
    assert kanban.get_task("b", "t1").status is TaskStatus.DONE  # type: ignore[union-attr]
    assert row_state(store, offer.row_id)["state"] == "running"


def test_settle_run_touches_only_the_exact_run_in_the_given_states(
    store: PoolStore, kanban: KanbanBoard
) -> None:
    offer = given_running(store, kanban)
    with store.session() as s:
        assert (
            transitions.settle_run(
                s,
                board="b",
                task_id="t1",
                run_id=offer.run_id + 1,
                to=RowState.STALE,
                states=[RowState.RUNNING],
                now=NOW,
            )
            is None
        )
        assert (
            transitions.settle_run(
                s,
                board="b",
                task_id="t1",
                run_id=offer.run_id,
                to=RowState.STALE,
                states=[RowState.ASSIGNED],
                now=NOW,
            )
            is None
        )
    assert row_state(store, offer.row_id)["state"] == "running"

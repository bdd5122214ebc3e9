"""Operator moves that reach board and pool: cancel and abandon fence the holder out at once."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
from sqlalchemy import text

from board import Board, FlakyBoard, TaskStatus
from core.errors import InvalidInput, LineageLive, NotFound, StaleHolder, TransientError
from poolkeeper import operator
from store import Child, Offer, PoolStore, audit, queries, transitions
from store.models import RowState
from tasks.collectors import StoreCollector
from tasks.maintain import maintain_once
from tasks.plane import Plane
from tests.factories import NOW, OWNER, envelope, grant, row_state


def given_running(store: PoolStore, kanban: Board, task_id: str = "t1", ordinal: int = 0) -> Offer:
    """A task claimed from the board, its row on ``ordinal``, taken by that ordinal's worker."""
    kanban.add_task("b", f"task {task_id}", task_id=task_id)
    [claim] = kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    store.add_run(board="b", task_id=task_id, run_id=claim.run_id, ordinal=ordinal, payload={"t": 1}, now=NOW)
    offer = store.offer(ordinal, owner=OWNER, now=NOW)
    assert offer is not None
    return offer


def given_quarantined(store: PoolStore, row_id: int) -> None:
    with store.session() as s:
        s.execute(
            text(
                "UPDATE assignments SET quarantined = :q, failures = 5, last_error = 'poisoned' WHERE id = :i"
            ),
            {"q": True, "i": row_id},
        )


# --- cancel ----------------------------------------------------------------------


def test_cancel_of_a_running_task_fences_its_worker_out_at_once(
    store: PoolStore, kanban: Board, plane: Plane
) -> None:
    offer = given_running(store, kanban)
    got = operator.cancel(kanban, store, "b", "t1", NOW)
    assert got.settled is not None and (got.settled.row_id, got.settled.was) == (offer.row_id, "running")
    with pytest.raises(StaleHolder, match=f"state: stale holder refused: row {offer.row_id} is stale"):
        store.heartbeat(envelope(offer, "hb"), now=NOW + 1)
    with pytest.raises(StaleHolder):
        store.accept_result(envelope(offer, "res", payload={"status": "done"}), now=NOW + 1)
    assert store.offer(0, owner=OWNER, now=NOW + 1) is None, "the run is not offered again"
    maintain_once(plane, NOW + 2)  # the plane afterwards agrees: nothing to undo
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.DONE and task.result == {"cancelled": True}
    assert row_state(store, offer.row_id)["state"] == "stale"
    with store.session(readonly=True) as s:
        assert queries.free_ordinals(s, store.pool_size) == [0, 1, 2]


def test_cancel_of_a_task_with_no_live_row_changes_only_the_board(store: PoolStore, kanban: Board) -> None:
    kanban.add_task("b", "ready one", task_id="t1")
    got = operator.cancel(kanban, store, "b", "t1", NOW)
    assert got.settled is None and got.task.status is TaskStatus.DONE


def test_cancel_leaves_the_row_to_reconcile_when_the_store_is_busy(
    store: PoolStore, kanban: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    offer = given_running(store, kanban)

    def busy(*_: object, **__: object) -> None:
        raise TransientError("pool store: database is locked")

    monkeypatch.setattr(transitions, "settle_run", busy)
    got = operator.cancel(kanban, store, "b", "t1", NOW)
    assert got.left_to_reconcile == "pool store: database is locked"
    assert kanban.get_task("b", "t1").status is TaskStatus.DONE  # type: ignore[union-attr]
    assert row_state(store, offer.row_id)["state"] == "running"


def test_settle_run_touches_only_the_exact_run_in_the_given_states(store: PoolStore, kanban: Board) -> None:
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


# --- abandon ---------------------------------------------------------------------


def test_abandon_parks_the_exact_run_frees_the_ordinal_and_fences_the_holder(
    store: PoolStore, kanban: Board, caplog: pytest.LogCaptureFixture
) -> None:
    offer = given_running(store, kanban)
    assert store.accept_result(envelope(offer, payload={"status": "done"}), now=NOW) == "applied"
    given_quarantined(store, offer.row_id)
    with store.session(readonly=True) as s:
        assert queries.quarantined_ordinals(s) == [0]
        assert queries.free_ordinals(s, store.pool_size) == [1, 2]
    caplog.set_level(logging.WARNING, "poolkeeper.operator")
    got = operator.abandon(kanban, store, offer.row_id, "poisoned result", NOW)
    assert got.parked and got.settled is not None and got.settled.was == "result"
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.BLOCKED
    assert (task.block_kind, task.block_reason) == ("operator", "abandoned by operator: poisoned result")
    row = row_state(store, offer.row_id)
    assert (row["state"], row["quarantined"], row["result"]) == ("stale", False, None)
    with store.session(readonly=True) as s:
        assert queries.quarantined_ordinals(s) == []
        assert queries.free_ordinals(s, store.pool_size) == [0, 1, 2]
    [line] = [r.getMessage() for r in caplog.records if r.name == "poolkeeper.operator"]
    assert line == f"abandon: row {offer.row_id} b/t1 run 1 (result): abandoned by operator: poisoned result"


def test_abandon_settles_a_run_the_board_already_moved_on(store: PoolStore, kanban: Board) -> None:
    offer = given_running(store, kanban)
    kanban.reassign_task("b", "t1", assignee="someone", lane="humans")  # run 2 now; run 1 moved on
    got = operator.abandon(kanban, store, offer.row_id, "gone", NOW)
    assert not got.parked and got.settled is not None
    assert row_state(store, offer.row_id)["state"] == "stale"
    task = kanban.get_task("b", "t1")
    assert task is not None and task.status is TaskStatus.RUNNING and task.current_run_id == 2, (
        "board untouched"
    )
    with pytest.raises(StaleHolder):
        store.heartbeat(envelope(offer, "late"), now=NOW + 1)


def test_abandon_of_a_result_the_board_already_applied_settles_it_finalized(
    store: PoolStore, kanban: Board
) -> None:
    # Given a delivered result that the board already holds (the results pass died before settling)
    offer = given_running(store, kanban)
    assert store.accept_result(envelope(offer, payload={"status": "done", "n": 7}), now=NOW) == "applied"
    assert kanban.complete_task("b", "t1", 1, {"status": "done", "n": 7})
    # When the operator abandons the row
    got = operator.abandon(kanban, store, offer.row_id, "stuck", NOW)
    # Then the board's word on that exact run decides: it ended it, so the row is finalized
    assert not got.parked and got.settled is not None and got.settled.was == "result"
    assert row_state(store, offer.row_id)["state"] == "finalized"
    with store.session(readonly=True) as s:
        [event] = [e for e in audit.history(s, offer.row_id) if e["kind"] == "abandon"]
    assert "board: the run is done" in event["detail"]


def test_abandon_changes_nothing_while_the_board_is_busy(store: PoolStore, kanban: Board) -> None:
    offer = given_running(store, kanban)
    busy = FlakyBoard(kanban, busy_rate=1.0)
    with pytest.raises(TransientError, match="board"):
        operator.abandon(busy, store, offer.row_id, "later", NOW)
    assert row_state(store, offer.row_id)["state"] == "running"
    assert kanban.get_task("b", "t1").status is TaskStatus.RUNNING  # type: ignore[union-attr]
    assert store.heartbeat(envelope(offer, "still-mine"), now=NOW + 1) == "applied"


@pytest.mark.parametrize("state", [RowState.FINALIZED, RowState.STALE])
def test_abandon_refuses_a_settled_row(
    store: PoolStore, kanban: Board, make_row: object, state: RowState
) -> None:
    row = make_row(state)  # type: ignore[operator]
    with pytest.raises(InvalidInput, match=f"row {row} is {state.value}: a settled row is never abandoned"):
        operator.abandon(kanban, store, row, "x", NOW)
    assert row_state(store, row)["state"] == state.value


def test_abandon_refuses_an_unknown_row_or_an_empty_reason(store: PoolStore, kanban: Board) -> None:
    with pytest.raises(NotFound, match="row 42: no such row"):
        operator.abandon(kanban, store, 42, "x", NOW)
    offer = given_running(store, kanban)
    with pytest.raises(InvalidInput, match="reason: must be 1 to 500 characters"):
        operator.abandon(kanban, store, offer.row_id, " ", NOW)
    assert row_state(store, offer.row_id)["state"] == "running"


def _snapshot(store: PoolStore, kanban: Board) -> tuple[object, ...]:
    with store.session(readonly=True) as s:
        rows = s.execute(text("SELECT * FROM assignments ORDER BY id")).all()
        kids = s.execute(text("SELECT * FROM child_executions ORDER BY id")).all()
    return rows, kids, kanban.get_task("b", "t1")


@pytest.mark.parametrize("status", ["registered", "running"])
def test_abandon_is_refused_while_a_child_is_live_and_changes_nothing(
    store: PoolStore, kanban: Board, status: str
) -> None:
    offer = given_running(store, kanban)
    child = store.register_child(grant(offer), now=NOW)
    if status == "running":
        store.child_heartbeat(child.token(), now=NOW)
    before = _snapshot(store, kanban)
    refused = rf"^row {offer.row_id} has live child executions \(1 {status}\): {re.escape(child.id)};"
    with pytest.raises(LineageLive, match=refused):
        operator.abandon(kanban, store, offer.row_id, "stuck", NOW + 1)
    assert _snapshot(store, kanban) == before  # the board was not asked either
    assert store.child_heartbeat(child.token(), now=NOW + 1) == "applied"


def test_abandon_discards_unknown_children_never_replaying_them(store: PoolStore, kanban: Board) -> None:
    offer = given_running(store, kanban)
    lost = store.register_child(grant(offer), now=NOW)
    assert store.child_vanished(grant(offer, child_id=lost.id), now=NOW) == 1

    got = operator.abandon(kanban, store, offer.row_id, "worker gone", NOW + 1)

    assert got.parked and got.settled is not None
    with store.session(readonly=True) as s:
        kids = s.execute(text("SELECT status, outcome FROM child_executions")).all()
    assert [tuple(k) for k in kids] == [("terminal", "discarded")]
    with pytest.raises(StaleHolder):
        store.child_heartbeat(lost.token(), now=NOW + 1)
    with store.session(readonly=True) as s:
        last = audit.history(s, offer.row_id)[-1]
    assert last["kind"] == "abandon" and last["detail"].endswith("; 1 unknown child execution(s) discarded")


def test_a_child_registered_during_abandon_stops_it_before_the_store_changes(
    store: PoolStore, kanban: Board
) -> None:
    offer = given_running(store, kanban)
    registered: list[Child] = []

    class Racing(FlakyBoard):  # the holder registers a child while the board parks the run
        def block_task(self, *args: Any, **kwargs: Any) -> bool:
            registered.append(store.register_child(grant(offer), now=NOW))
            return kanban.block_task(*args, **kwargs)

    with pytest.raises(LineageLive, match="the board task is parked, so reconcile settles the row"):
        operator.abandon(Racing(kanban, busy_rate=0.0), store, offer.row_id, "stuck", NOW + 1)
    assert row_state(store, offer.row_id)["state"] == "running"
    assert store.child_heartbeat(registered[0].token(), now=NOW + 1) == "applied"


def test_ordinals_gauge_tells_free_held_and_quarantined(store: PoolStore, kanban: Board) -> None:
    first = given_running(store, kanban, "t1", 0)
    given_running(store, kanban, "t2", 1)
    given_quarantined(store, first.row_id)
    [ordinals] = [m for m in StoreCollector(store).collect() if m.name == "poolkeeper_ordinals"]
    assert {s.labels["state"]: s.value for s in ordinals.samples} == {"free": 1, "held": 1, "quarantined": 1}

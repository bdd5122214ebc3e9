"""Dispatch: claims no more runs than free ordinals, gives reservations back, absorbs a busy board."""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy import delete

from board import Board, FlakyBoard
from store.models import OrdinalPresence
from tasks.plane import Plane
from tests.factories import NOW, dispatched
from tests.helpers import staff


def test_dispatch_claims_no_more_than_free_ordinals(plane: Plane, kanban: Board) -> None:
    for i in range(5):
        kanban.add_task("b", f"t{i}", task_id=f"t{i}")
    claims = dispatched(plane)
    assert sorted(c["ordinal"] for c in claims) == [0, 1, 2]
    assert dispatched(plane) == []  # the ordinals are reserved for the claims in flight
    assert kanban.counts_by_status()["ready"] == 2


def test_dispatch_fills_only_ordinals_whose_worker_called_within_a_lease(plane: Plane, kanban: Board) -> None:
    # Given a worker on ordinal 0 seen just now, one on ordinal 1 last seen over a lease ago, none on 2
    lease = plane.settings.lease_seconds
    staff(plane.store, [0], NOW)
    staff(plane.store, [1], NOW - lease - 1)
    with plane.store.engine.begin() as conn:
        conn.execute(delete(OrdinalPresence).where(OrdinalPresence.ordinal == 2))
    for i in range(3):
        kanban.add_task("b", f"t{i}", task_id=f"t{i}")
    # Then one claim, on ordinal 0, and the other tasks stay ready for a worker to come
    assert [c["ordinal"] for c in dispatched(plane)] == [0]
    assert kanban.counts_by_status()["ready"] == 2


def test_dispatch_surfaces_a_programming_error(plane: Plane) -> None:
    class ChangedBoard(FlakyBoard):
        def claim_ready(self, *args: Any, **kwargs: Any) -> Any:
            raise AttributeError("claim_ready() got an unexpected keyword 'lane'")

    plane.board = ChangedBoard(plane.board)
    with pytest.raises(AttributeError):
        dispatched(plane)
    assert plane.coord.reserve(range(3)) == [0, 1, 2], "reservations were released"


def test_dispatch_absorbs_a_busy_board(plane: Plane, kanban: Board) -> None:
    kanban.add_task("b", "t", task_id="t")
    plane.board = FlakyBoard(kanban, busy_rate=0.999999)
    assert dispatched(plane) == []
    assert kanban.counts_by_status()["ready"] == 1


def test_a_board_busy_tick_after_tick_is_logged_once_and_again_after_a_good_tick(
    plane: Plane, kanban: Board, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a board that stays busy
    kanban.add_task("b", "t", task_id="t")
    healthy, plane.board = plane.board, FlakyBoard(kanban, busy_rate=0.999999)
    # When dispatch meets it on three ticks, one line says so
    for _ in range(3):
        assert dispatched(plane) == []
    busy = [r for r in caplog.records if "board busy" in r.getMessage()]
    assert len(busy) == 1 and busy[0].getMessage().startswith("dispatch all: board busy")
    # Then a good tick in between makes the next busy tick news again
    plane.board = healthy
    kanban.add_task("b", "u", task_id="u")
    assert len(dispatched(plane)) == 2
    plane.board = FlakyBoard(kanban, busy_rate=0.999999)
    assert dispatched(plane) == []
    assert len([r for r in caplog.records if "board busy" in r.getMessage()]) == 2

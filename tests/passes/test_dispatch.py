"""Dispatch: claims no more runs than free ordinals, gives reservations back, absorbs a busy board."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy import delete

from board import Board, FlakyBoard
from store import audit, pause
from store.models import OrdinalPresence
from tasks import runner
from tasks.plane import Plane
from tests.factories import NOW, claimed, dispatched, scanned
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


def test_while_paused_dispatch_claims_nothing_says_so_once_and_claimed_runs_go_on(
    plane: Plane, kanban: Board, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "poolkeeper")
    # Given a run claimed before the pause, and a task that arrives after it
    [row] = claimed(plane, kanban, 1)
    with plane.store.session() as s:
        assert pause.pause(s, "deploy 42", now=NOW, actor=audit.OPERATOR)
    kanban.add_task("b", "later", task_id="later")
    # When dispatch ticks three times, it claims nothing and one line says why
    for _ in range(3):
        assert dispatched(plane) == []
    assert kanban.counts_by_status()["ready"] == 1
    said = [r.getMessage() for r in caplog.records if "paused" in r.getMessage()]
    assert said == ["dispatch all: paused by operator: deploy 42; claiming nothing until `poolctl resume`"]
    # Then the claimed run is still served and maintained: granted, and expired past its lease
    grant = plane.store.offer(0, owner="w0", now=NOW)
    assert grant is not None and grant.row_id == row
    late = grant.lease_until + 1
    assert scanned(plane, "expire", late)["expire"] == [row]
    assert runner.run_batch(plane, "expire", [row], late).done == [(row, "reoffered")]
    # And once resumed, the next tick claims again (and a later pause is news again)
    with plane.store.session() as s:
        assert pause.resume(s, now=NOW + 1, actor=audit.OPERATOR)
    assert len(dispatched(plane)) == 1 and kanban.counts_by_status()["ready"] == 0

"""Dispatch: claims no more runs than free ordinals, gives reservations back, absorbs a busy board."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import delete

from board import Board, FlakyBoard
from core.errors import Unavailable
from store import audit, pause, queries
from store.models import OrdinalPresence
from tasks import runner, scan
from tasks.plane import Plane
from tests.factories import NOW, claim_on_a_taken_ordinal, claimed, dispatched, scanned
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


def test_a_paused_board_gives_nothing_while_the_others_are_claimed(plane: Plane, kanban: Board) -> None:
    # Given board "b" paused on its own, and ready tasks on "b" and on "c"
    with plane.store.session() as s:
        assert pause.pause(s, "migrating b", now=NOW, actor=audit.OPERATOR, board="b")
        assert not pause.pause(s, "again", now=NOW, actor=audit.OPERATOR, board="b")  # unchanged
    for board in ("b", "c"):
        for i in range(2):
            kanban.add_task(board, f"{board}{i}", task_id=f"{board}{i}")
    # When dispatch ticks with three free ordinals, it claims only "c"'s two, and "b"'s stay ready
    assert sorted((c["board"], c["task_id"]) for c in dispatched(plane)) == [("c", "c0"), ("c", "c1")]
    assert {t.id for t in kanban.list_tasks("b")} == {"b0", "b1"}
    assert all(t.status.value == "ready" for t in kanban.list_tasks("b"))
    # Then resuming "b" alone (the pool-wide pause untouched) lets the next tick claim one of them
    with plane.store.session() as s:
        assert not pause.resume(s, now=NOW + 1, actor=audit.OPERATOR)  # the pool was not paused
        assert pause.resume(s, now=NOW + 1, actor=audit.OPERATOR, board="b")
        assert pause.boards(s) == {}
        kinds = [(e["kind"], e["detail"]) for e in audit.history(s, audit.POOL)]
    assert [c["board"] for c in dispatched(plane)] == ["b"]
    assert kinds == [("pause", "board b: migrating b"), ("resume", "board b")]


def waiting_claim(plane: Plane, kanban: Board, task_id: str) -> dict[str, Any]:
    """Every ordinal busy, and a claim of ``task_id`` on a taken ordinal that found none free: it waits."""
    job = claim_on_a_taken_ordinal(plane, kanban, task_id)
    assert runner.run_key(plane, "materialize", job, NOW) == "waits"
    return job


def free_one(plane: Plane, kanban: Board) -> int:
    """The row on ordinal 1 ends (its run moved on): ordinal 1 is free."""
    with plane.store.session() as s:
        [row] = [r for r in queries.rows(s) if r.ordinal == 1]
    kanban.reassign_task("b", row.task_id, assignee="alice", lane="humans")
    assert runner.run_key(plane, "reconcile", row.id, NOW) == "stale"
    return 1


def test_a_waiting_claim_still_pending_waits_again_in_its_place(plane: Plane, kanban: Board) -> None:
    # Given a waiting claim whose own message still holds its marker (its batch has not finished)
    job = waiting_claim(plane, kanban, "late")
    assert plane.coord.mark_pending("materialize", ["b:late:" + str(job["run_id"])])
    free_one(plane, kanban)
    # When dispatch serves it: it is left out (pending), and waits again, its ordinal free
    assert dispatched(plane) == []
    plane.coord.clear_pending("materialize", ["b:late:" + str(job["run_id"])])
    # Then the next round serves it
    [served] = dispatched(plane)
    assert (served["task_id"], served["ordinal"]) == ("late", 1)


def test_a_failed_hand_over_of_waiting_claims_frees_every_ordinal_and_keeps_them_waiting(
    plane: Plane, kanban: Board
) -> None:
    waiting_claim(plane, kanban, "late")
    free_one(plane, kanban)

    def broker_away(*_: Any) -> None:
        raise Unavailable("redis is unavailable: the broker went away")

    with pytest.raises(Unavailable):
        scan_with(plane, broker_away)
    assert plane.coord.reserve([0, 1, 2]) == [0, 1, 2], "no reservation left behind"
    plane.coord.release([0, 1, 2])
    [served] = dispatched(plane)
    assert served["task_id"] == "late", "still waiting after the failure"


def scan_with(plane: Plane, enqueue: Any) -> int:
    return scan.scan(plane, "materialize", NOW, enqueue)


def test_a_scan_whose_markers_cannot_be_queued_leaves_none_of_the_unsent_pending(
    plane: Plane, kanban: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    for i in range(3):
        kanban.add_task("b", f"t{i}", task_id=f"t{i}")
    plane.settings = replace(plane.settings, batch_size=1)
    sent: list[Any] = []

    def queue_pending_fails(*_: Any) -> None:
        raise Unavailable("redis is unavailable: stalled")

    monkeypatch.setattr(plane.coord, "queue_pending", queue_pending_fails)
    with pytest.raises(Unavailable):
        scan_with(plane, lambda name, keys: sent.extend(keys))
    assert len(sent) == 1, "the first batch went; the scan stopped there"
    names = [f"b:{c['task_id']}:{c['run_id']}" for c in sent]
    unsent = {f"t{i}" for i in range(3)} - {c["task_id"] for c in sent}
    monkeypatch.undo()
    # the unsent claims' markers are gone: reconcile may hand them over again
    assert plane.coord.mark_pending("materialize", names) == [], "the sent one is still pending"
    again = [f"b:{t}:1" for t in sorted(unsent)]
    assert plane.coord.mark_pending("materialize", again) == again

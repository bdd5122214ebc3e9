"""Results: a delivered result reaches the exact run once; a poisoned one is quarantined alone."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import text

from board import Board, TaskStatus
from tasks import runner
from tasks.plane import Plane
from tests.factories import NOW, OWNER, claimed, deliver, holder_envelope, row_state, running_row


@pytest.mark.parametrize(
    ("payload", "status"),
    [
        ({"status": "done", "answer": 42}, TaskStatus.DONE),
        ({"status": "blocked", "reason": "needs a human"}, TaskStatus.BLOCKED),
    ],
)
def test_result_is_applied_to_the_exact_run_and_replay_is_harmless(
    plane: Plane, kanban: Board, payload: dict[str, Any], status: TaskStatus
) -> None:
    row = running_row(plane, kanban)
    deliver(plane, row, payload)
    assert runner.run_key(plane, "results", row, NOW) == "finalized"
    task = kanban.get_task("b", "b0")
    assert task is not None and task.status is status
    assert runner.run_key(plane, "results", row, NOW) == "lost_race"  # replay: nothing twice


def test_crash_between_board_and_store_is_recovered_as_finalized(plane: Plane, kanban: Board) -> None:
    row = running_row(plane, kanban)
    deliver(plane, row, {"status": "done"})
    assert kanban.complete_task("b", "b0", 1, {"status": "done"})  # the board write landed, then a crash
    assert runner.run_key(plane, "results", row, NOW) == "finalized"


def test_poisoned_result_is_quarantined_and_others_go_on(
    plane: Plane, kanban: Board, caplog: pytest.LogCaptureFixture
) -> None:
    rows = claimed(plane, kanban, 3)
    for row in rows:
        assert plane.store.offer(row_state(plane.store, row)["ordinal"], owner=OWNER, now=NOW) is not None
        deliver(plane, row, {"status": "done"})
    poisoned = rows[1]
    with plane.store.session() as s:
        s.execute(text("UPDATE assignments SET result='{broken' WHERE id=:i"), {"i": poisoned})
    caplog.set_level(logging.INFO, "poolkeeper")
    outcomes = [runner.run_batch(plane, "results", rows, NOW).outcomes for _ in range(3)]
    assert outcomes[0] == {"finalized": 2, "failed": 1}
    assert outcomes[2] == {"lost_race": 2, "quarantined": 1}
    got = row_state(plane.store, poisoned)
    assert got["state"] == "result" and got["quarantined"] and "JSONDecodeError" in got["last_error"]
    failure_lines = [r for r in caplog.records if "JSONDecodeError" in r.getMessage()]
    assert len(failure_lines) == 1, "an unchanged failure is reported once"
    quarantine = [r.getMessage() for r in caplog.records if "quarantined after" in r.getMessage()]
    assert quarantine == [f"results row {poisoned} quarantined after 3 failures in a row (poolctl requeue)"]


def test_a_settled_result_observes_its_run_time_once(plane: Plane, kanban: Board) -> None:
    """Given a run granted at NOW whose result came 7 s later: settling it counts 7 s in
    ``poolkeeper_run_seconds``; the replay that finds it settled counts nothing."""
    row = running_row(plane, kanban)
    plane.store.accept_result(holder_envelope(plane.store, row, "r", payload={"status": "done"}), now=NOW + 7)
    before = runs()
    assert runner.run_key(plane, "results", row, NOW + 8) == "finalized"
    assert runner.run_key(plane, "results", row, NOW + 9) == "lost_race"
    count, total = runs()
    assert (count - before[0], total - before[1]) == (1, 7)


def runs() -> tuple[float, float]:
    """``poolkeeper_run_seconds``' count and sum in this process."""
    get = REGISTRY.get_sample_value
    return get("poolkeeper_run_seconds_count") or 0.0, get("poolkeeper_run_seconds_sum") or 0.0

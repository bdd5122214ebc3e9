"""What the board says about one row's exact run, and settling the row on it (invariant 2).

The passes that settle rows on the board's word (lease failures, results,
reconcile) read the row, ask the board with no store transaction open, then
settle with a conditional update; the rules for "authoritative evidence"
live here once (docs/design.md, "Evidence").
"""

from __future__ import annotations

from board import BoardTask, TaskStatus
from core.errors import LostRace
from store import audit, rows, transitions
from store.models import Assignment, RowState
from tasks.declaration import Outcome
from tasks.plane import Plane


def read_row(plane: Plane, row_id: int, *states: RowState) -> Assignment:
    """The row as it is now; ``LostRace`` if it is in none of ``states`` any more."""
    with plane.store.session(readonly=True) as s:
        row = rows.get_row(s, row_id)
    if row.state not in states:
        raise LostRace(f"row {row_id} is {row.state} now")
    return row


def verdict(task: BoardTask | None, run_id: int) -> RowState | None:
    """``stale`` if the run vanished or moved on, ``finalized`` if the board moved it on, else None."""
    if task is None or task.current_run_id != run_id:
        return RowState.STALE
    if task.status is not TaskStatus.RUNNING:
        return RowState.FINALIZED
    return None  # still running: no evidence yet


def described(task: BoardTask | None, run_id: int) -> str:
    """What the board said, in words: the evidence an audit event keeps beside ``verdict``."""
    if task is None:
        return "board: the task is gone"
    if task.current_run_id != run_id:
        return f"board: the task's current run is {task.current_run_id}, not {run_id}"
    return f"board: the run is {task.status.value}"


def settle(plane: Plane, row: Assignment, to: RowState, now: float, *, by: str, evidence: str) -> Outcome:
    """Settle the row on ``evidence``, as the pass named ``by``; its audit event keeps both."""
    with plane.store.session() as s:
        transitions.settle(
            s,
            row.id,
            to,
            expect_state=row.state,
            expect_attempt=row.attempt,
            now=now,
            actor=audit.by_pass(by),
            evidence=evidence,
        )
    return Outcome(to.value)

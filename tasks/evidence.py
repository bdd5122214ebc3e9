"""What the board says about one row's exact run, and settling the row on it (SPEC invariant 2).

Both passes that settle rows on the board's word (lease failures, results)
read the row, ask the board with no store transaction open, then settle with
a conditional update; the rules for "authoritative evidence" live here once.
"""

from __future__ import annotations

from board import BoardTask, TaskStatus
from poolkeeper.errors import LostRace
from store import transitions
from store.models import Assignment, RowState
from tasks.plane import Plane


def read_row(plane: Plane, row_id: int, state: RowState) -> Assignment:
    """The row as it is now; ``LostRace`` if it already left ``state``."""
    with plane.store.session(readonly=True) as s:
        row = transitions.get_row(s, row_id)
    if row.state != state.value:
        raise LostRace(f"row {row_id} is {row.state} now")
    return row


def verdict(task: BoardTask | None, run_id: int) -> RowState | None:
    """``stale`` if the run vanished or moved on, ``finalized`` if the board moved it on, else None."""
    if task is None or task.current_run_id != run_id:
        return RowState.STALE
    if task.status is not TaskStatus.RUNNING:
        return RowState.FINALIZED
    return None  # still running: no evidence yet


def settle(plane: Plane, row: Assignment, to: RowState, now: float) -> str:
    with plane.store.session() as s:
        transitions.settle(s, row.id, to, expect_state=row.state, expect_attempt=row.attempt, now=now)
    return to.value

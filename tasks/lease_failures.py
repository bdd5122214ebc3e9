"""Recover lease failure.

Qualifies: a ``lease_failed`` row whose backoff has run out. These rows are
never collected and never hidden: every cycle revisits them until settled.
Does, on evidence about the row's exact board run:
- the task is gone, or its current run is another one: ``stale``;
- the task is no longer ``running``: ``finalized`` (the board already moved it);
- else park exactly that run (``block_task`` with ``expected_run_id``), and
  ``finalized`` once the board accepted it.
If the board refuses yet still shows the run running there is no evidence:
the row stays ``lease_failed`` and is retried (``TransientError``).
Returns: ``"stale"`` or ``"finalized"``.
"""

from __future__ import annotations

from board import TaskStatus
from poolkeeper.errors import LostRace, TransientError
from store import queries, transitions
from store.models import RowState
from tasks.plane import Plane


def due(plane: Plane, now: float, limit: int, offset: int = 0) -> list[int]:
    with plane.store.session(readonly=True) as s:
        return queries.due_in_state(s, RowState.LEASE_FAILED, now=now, limit=limit, offset=offset)


def run(plane: Plane, row_id: int, now: float) -> str:
    # Read, ask the board, then write: no store transaction is held across a board call.
    with plane.store.session(readonly=True) as s:
        row = transitions.get_row(s, row_id)
    if row.state != RowState.LEASE_FAILED.value:
        raise LostRace(f"row {row_id} is {row.state} now")
    task = plane.board.get_task(row.board, row.task_id)
    if task is None or task.current_run_id != row.run_id:
        to = RowState.STALE
    elif task.status is not TaskStatus.RUNNING:
        to = RowState.FINALIZED
    else:
        reason = f"lease expired after {row.attempt} fenced attempts"
        if not plane.board.block_task(row.board, row.task_id, reason, "transient", row.run_id):
            raise TransientError(f"board refused to park {row.board}/{row.task_id} run {row.run_id}")
        to = RowState.FINALIZED
    with plane.store.session() as s:
        transitions.settle(s, row_id, to, expect_state=row.state, expect_attempt=row.attempt, now=now)
    return to.value

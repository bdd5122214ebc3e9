"""Operator moves that must reach both the board and the pool store.

The board decides first (it is the source of truth); then the run's row is
settled with a guarded update, so its holder is fenced out at once: its
heartbeats and results are refused as stale. If the process dies between the
two, reconcile (or the results pass) settles the row later; nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass

from board import BoardTask, KanbanBoard
from core.errors import TransientError
from store import PoolStore, transitions
from store.models import LIVE_STATES, RowState


@dataclass(frozen=True)
class Cancelled:
    task: BoardTask
    settled: transitions.Settled | None  # the run's live row, now stale; None if there was none
    left_to_reconcile: str | None = None  # why the row could not be settled now (the cancel stands)


def cancel(kanban: KanbanBoard, store: PoolStore, board: str, task_id: str, now: float) -> Cancelled:
    """Cancel the task on the board, then make its run's live row ``stale``.

    A busy board raises ``TransientError`` with nothing changed. A busy store
    after the cancel cannot undo it: the result says the row is left to
    reconcile, which settles it on the board's word.
    """
    task = kanban.cancel_task(board, task_id)
    if task.current_run_id is None:
        return Cancelled(task, None)
    try:
        with store.session() as s:
            settled = transitions.settle_run(
                s,
                board=board,
                task_id=task_id,
                run_id=task.current_run_id,
                to=RowState.STALE,
                states=LIVE_STATES,
                now=now,
            )
    except TransientError as err:
        return Cancelled(task, None, left_to_reconcile=str(err))
    return Cancelled(task, settled)

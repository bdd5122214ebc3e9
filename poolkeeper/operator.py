"""Operator moves that must reach both the board and the pool store.

The board decides first (it is the source of truth); then the run's row is
settled with a guarded update, so its holder is fenced out at once: its
heartbeats and results are refused as stale. If the process dies between the
two, reconcile (or the results pass) settles the row later; nothing is lost.
Each settle is one audit event of its own kind (``cancel``, ``abandon``) by
the operator, with the reason, never a ``settle`` beside it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from board import Board, BoardTask
from core.errors import InvalidInput, LineageLive, TransientError
from store import PoolStore, audit, lineage, rows, transitions
from store.models import LIVE_STATES, TERMINAL_STATES, EventKind, RowState
from tasks.evidence import described, verdict

log = logging.getLogger("poolkeeper.operator")
NOT_TERMINAL = tuple(s for s in RowState if s not in TERMINAL_STATES)
MAX_REASON_CHARS = 500


@dataclass(frozen=True)
class Cancelled:
    task: BoardTask
    settled: transitions.Settled | None  # the run's live row, now stale; None if there was none
    left_to_reconcile: str | None = None  # why the row could not be settled now (the cancel stands)


@dataclass(frozen=True)
class Abandoned:
    row_id: int
    board: str
    task_id: str
    run_id: int
    parked: bool  # False: the board had already moved the run on (its evidence)
    settled: transitions.Settled | None  # None: another writer settled the row in between
    reason: str


def cancel(
    board: Board, store: PoolStore, board_name: str, task_id: str, now: float, *, reason: str = ""
) -> Cancelled:
    """Cancel the task on the board, then make its run's live row ``stale`` (``reason``, when
    given, on the row's audit trail).

    A busy board raises ``TransientError`` with nothing changed. A busy store
    after the cancel cannot undo it: the result says the row is left to
    reconcile, which settles it on the board's word.
    """
    task = board.cancel_task(board_name, task_id)
    if task.current_run_id is None:
        return Cancelled(task, None)
    try:
        with store.session() as s:
            settled = transitions.settle_run(
                s,
                board=board_name,
                task_id=task_id,
                run_id=task.current_run_id,
                to=RowState.STALE,
                states=LIVE_STATES,
                now=now,
                actor=audit.OPERATOR,
                evidence="task cancelled on the board by the operator" + (f": {reason}" if reason else ""),
                kind=EventKind.CANCEL,
            )
    except TransientError as err:
        return Cancelled(task, None, left_to_reconcile=str(err))
    return Cancelled(task, settled)


def abandon(board: Board, store: PoolStore, row_id: int, reason: str, now: float) -> Abandoned:
    """Give up on a row for good: park its exact run on the board, then settle the row ``stale``
    (``finalized`` when the board had already ended that exact run, e.g. with this row's result).

    Refuses a terminal row, and a row with a ``registered`` or ``running`` child
    (``LineageLive``, before the board is asked); ``unknown`` children are
    discarded with the settle, never replayed. The park is compare-and-set on the row's run: if
    the board refuses because the run already moved on, its word on the run is
    the evidence (``tasks.evidence.verdict``) and the row is settled all the same. A busy board raises
    ``TransientError`` with nothing changed; a busy store after the park
    raises it too, and running ``abandon`` again finishes the job.
    """
    if not reason.strip() or len(reason) > MAX_REASON_CHARS:
        raise InvalidInput("reason", f"must be 1 to {MAX_REASON_CHARS} characters")
    with store.session(readonly=True) as s:
        row = rows.get_row(s, row_id)
    if row.state not in {state.value for state in NOT_TERMINAL}:
        raise InvalidInput("row", f"row {row_id} is {row.state}: a settled row is never abandoned")
    with store.session(readonly=True) as s:
        lineage.refuse_live(s, row_id)  # a reset waits for live children; the board is not told yet
    why = f"abandoned by operator: {reason}"
    parked = board.block_task(row.board, row.task_id, why, "operator", row.run_id)
    to, evidence = RowState.STALE, why
    if not parked:  # the board's word on the exact run decides, as the results pass reads it
        task = board.get_task(row.board, row.task_id)
        said = verdict(task, row.run_id)
        if said is None:
            raise TransientError(f"board refused to park {row.board}/{row.task_id} run {row.run_id}")
        to, evidence = said, f"{why} ({described(task, row.run_id)}: the board had already moved the run on)"
    with store.session() as s:
        rows.get_row(s, row_id, for_update=True)
        try:
            discarded = lineage.reset(s, row_id, now=now)  # again under the row's lock: `unknown` children
        except LineageLive as err:  # a child registered since the check: the board has parked the run
            raise LineageLive(f"{err}; the board task is parked, so reconcile settles the row") from None
        settled = transitions.settle_run(
            s,
            board=row.board,
            task_id=row.task_id,
            run_id=row.run_id,
            to=to,
            states=NOT_TERMINAL,
            now=now,
            actor=audit.OPERATOR,
            evidence=evidence + (f"; {discarded} unknown child execution(s) discarded" if discarded else ""),
            kind=EventKind.ABANDON,
        )
    log.warning(
        "abandon: row %d %s/%s run %d (%s): %s%s",
        row_id,
        row.board,
        row.task_id,
        row.run_id,
        row.state,
        why,
        "" if parked else " (the board had already moved the run on)",
    )
    return Abandoned(row_id, row.board, row.task_id, row.run_id, parked, settled, why)

"""Reconcile board.

Scanner (every ``reconcile_seconds``), for every board that has live rows, then
every other board the board lists (archived ones too), one board at a time; one
board's failure, or the listing's, is reported once and never stops the rest:
1. a live row (``assigned``/``running``) whose board run is not running any
   more is submitted to this pass (``result`` rows are left to the results
   pass, which applies or settles them on the board's answer);
2. runs the board says the pool holds (``running``, assigned to the pool, in
   the pool's lane) that have no row in any state (a retrying or
   not-yet-collected row counts) are handed to materialize on free ordinals,
   exactly as dispatch hands over its claims; with too few free, the rest wait
   for the next free ones, which dispatch hands to waiting claims before it
   claims anything new (``materialize.wait``). A claim already pending is left to it.
Per row, under the row's lock, on fresh evidence about its exact run: the
task vanished, its current run is another one, or it is no longer
``running`` → ``stale``; else the board still runs it → ``current``.
Returns: ``stale`` or ``current`` (``LostRace`` if the row moved on).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from board import BoardTask, TaskStatus
from core.errors import PoolError
from store import queries
from store.models import RowState
from tasks import evidence, failures, materialize
from tasks.declaration import Lock, Outcome, Pass, Submit
from tasks.plane import Plane

LIVE_HELD = (RowState.ASSIGNED, RowState.RUNNING)


def find(plane: Plane, now: float, submit: Submit) -> int:
    """The boards with live rows first, then the others the board lists: a failing registry
    (``list_boards``) never keeps a row whose run moved on live, so its worker stops."""
    with plane.store.session(readonly=True) as s:
        active = set(queries.boards_with_live_rows(s))
    enqueued = _scan_boards(plane, active, now, submit)
    try:
        listed = set(plane.board.list_boards(include_archived=True))
    except Exception as err:
        _report("boards", err)
        return enqueued
    failures.reporter.succeeded(PASS.name, "boards")
    return enqueued + _scan_boards(plane, listed - active, now, submit)


def _scan_boards(plane: Plane, boards: set[str], now: float, submit: Submit) -> int:
    enqueued = 0
    for board in sorted(boards):
        try:
            enqueued += _scan_board(plane, board, now, submit)
        except Exception as err:
            _report(f"board {board}", err)
        else:
            failures.reporter.succeeded(PASS.name, f"board {board}")
    return enqueued


def _report(what: str, err: Exception) -> None:
    """Once per distinct detail; the next board (or the listed ones) goes on regardless."""
    level = logging.WARNING if isinstance(err, PoolError) else logging.ERROR  # ERROR: a bug
    failures.reporter.once(PASS.name, what, failures.describe(err), level)


def _scan_board(plane: Plane, board: str, now: float, submit: Submit) -> int:
    with plane.store.session(readonly=True) as s:
        live = [(r.id, r.task_id, r.run_id) for r in queries.rows_of_board(s, board, LIVE_HELD)]
    running = {t.id: t for t in plane.board.running_tasks(board)}
    moved_on = [
        row_id
        for row_id, task_id, run_id in live
        if task_id not in running or running[task_id].current_run_id != run_id
    ]
    enqueued = len(submit(PASS.name, moved_on))
    orphans = _orphans(plane, board, running.values())
    if orphans:
        ordinals = materialize.reserve_free(plane, len(orphans), now)
        enqueued += len(materialize.hand_over(plane, orphans[: len(ordinals)], ordinals, submit))
        materialize.wait(plane, orphans[len(ordinals) :])  # the next free ordinals are theirs
    return enqueued


def _orphans(plane: Plane, board: str, running: Iterable[BoardTask]) -> list[materialize.Claim]:
    pool = [
        t
        for t in running
        if t.assignee == plane.settings.assignee and t.lane == plane.settings.lane and t.current_run_id
    ]
    if not pool:
        return []
    with plane.store.session(readonly=True) as s:
        known = queries.known_runs(s, board, [(t.id, t.current_run_id or 0) for t in pool])
    return [
        {"board": t.board, "task_id": t.id, "run_id": t.current_run_id}
        for t in pool
        if (t.id, t.current_run_id) not in known
    ]


def run(plane: Plane, row_id: int, now: float) -> Outcome:
    row = evidence.read_row(plane, row_id, *LIVE_HELD)
    task: BoardTask | None = plane.board.get_task(row.board, row.task_id)
    if task is not None and task.current_run_id == row.run_id and task.status is TaskStatus.RUNNING:
        return Outcome.CURRENT
    why = evidence.described(task, row.run_id)
    return evidence.settle(plane, row, RowState.STALE, now, by=PASS.name, evidence=why)


PASS = Pass(
    name="reconcile",
    lock=Lock.ROW,
    interval=lambda s: s.reconcile_seconds,
    find=find,
    run=run,
)

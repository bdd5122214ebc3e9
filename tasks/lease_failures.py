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
Returns: ``stale`` or ``finalized``.
"""

from __future__ import annotations

from functools import partial

from core.errors import TransientError
from store import queries
from store.models import RowState
from tasks import evidence
from tasks.declaration import Lock, Outcome, Pass, due_rows
from tasks.plane import Plane


def run(plane: Plane, row_id: int, now: float) -> Outcome:
    row = evidence.read_row(plane, row_id, RowState.LEASE_FAILED)
    task = plane.board.get_task(row.board, row.task_id)
    to, why = evidence.verdict(task, row.run_id), evidence.described(task, row.run_id)
    if to is None:
        reason = f"lease expired after {row.attempt} fenced attempts"
        if not plane.board.block_task(row.board, row.task_id, reason, "transient", row.run_id):
            raise TransientError(f"board refused to park {row.board}/{row.task_id} run {row.run_id}")
        to, why = RowState.FINALIZED, f"board: parked the run ({reason})"
    return evidence.settle(plane, row, to, now, by=PASS.name, evidence=why)


PASS = Pass(
    name="lease_failures",
    lock=Lock.ROW,
    interval=lambda s: s.tick_seconds,
    find=due_rows("lease_failures", partial(queries.due_in_state, state=RowState.LEASE_FAILED)),
    run=run,
)

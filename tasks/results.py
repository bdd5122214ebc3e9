"""Recover result.

Qualifies: a ``result`` row (a worker delivered; the board does not know yet)
whose backoff has run out.
Does: applies the stored result to the board for the exact run: completes it,
or parks it when the result says ``blocked``; then ``finalized``. When the
board refuses, its answer is the evidence: the run moved on or vanished gives
``stale``; the run already left ``running`` (a replay after a crash, or an
operator) gives ``finalized``; still running means retry (``TransientError``).
A stored result that cannot be read (poisoned data) raises and is recorded on
this row only. Replaying this pass is harmless: the board calls are
compare-and-set and the settle is conditional.
Observes: the run's time from its grant to its result (``poolkeeper_run_seconds``), read
from the audit trail once the row is settled: the result was accepted by whichever
``serve`` replica (or embedded store) the worker spoke to, so the plane's exporter, which
sees every run, is where one histogram holds them all.
Returns: ``finalized`` or ``stale``.
"""

from __future__ import annotations

import json
from functools import partial

from core import tracing
from core.errors import TransientError
from store import queries, trends
from store.models import Assignment, RowState
from tasks import evidence
from tasks.declaration import Lock, Outcome, Pass, due_rows
from tasks.plane import Plane


def run(plane: Plane, row_id: int, now: float) -> Outcome:
    row = evidence.read_row(plane, row_id, RowState.RESULT)
    with tracing.span("finalize", row.traceparent, {"pool.row_id": row.id, "pool.attempt": row.attempt}):
        return _finalize(plane, row, now)


def _finalize(plane: Plane, row: Assignment, now: float) -> Outcome:
    result = json.loads(row.result or "")
    if result["status"] == "blocked":
        applied = plane.board.block_task(row.board, row.task_id, str(result["reason"]), "worker", row.run_id)
        why = f"board: parked the run with the result ({result['reason']})"
    else:
        applied = plane.board.complete_task(row.board, row.task_id, row.run_id, result)
        why = "board: completed the run with the result"
    to: RowState | None = RowState.FINALIZED
    if not applied:
        task = plane.board.get_task(row.board, row.task_id)
        to = evidence.verdict(task, row.run_id)
        why = f"{evidence.described(task, row.run_id)}; the result was not applied"
    if to is None:
        raise TransientError(f"board refused the result of {row.board}/{row.task_id} run {row.run_id}")
    settled = evidence.settle(plane, row, to, now, by=PASS.name, evidence=why)
    # Once per run (a settled row is never due here again), from the trail the console reads too.
    with plane.store.session(readonly=True) as s:
        ran = trends.run_seconds(s, row.id)
    if ran is not None:
        from tasks import metrics  # prometheus_client: not for `poolctl status`, which reads PASSES

        metrics.RUN_SECONDS.observe(max(0.0, ran))
    return settled


PASS = Pass(
    name="results",
    lock=Lock.ROW,
    interval=lambda s: s.tick_seconds,
    find=due_rows("results", partial(queries.due_in_state, state=RowState.RESULT)),
    run=run,
)

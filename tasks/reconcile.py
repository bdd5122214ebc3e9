"""Reconcile board (one board per call).

Qualifies: every live row of the board, and every run the board says the pool
holds.
Does:
1. a live row (``assigned``/``running``) whose board run moved on or is no
   longer ``running`` becomes ``stale`` (``result`` rows are left to the
   results pass, which applies or settles them on the board's answer);
2. then, while ordinals are free, every board task that is ``running``,
   assigned to the pool, in the pool's lane, and whose run has no row in any
   state (a retrying or not-yet-collected row counts) is adopted onto a free
   ordinal with attempt 1. Claims whose materialize message is still queued
   are left to it.
Each row and each task is isolated: one failure never stops the next.
Returns: a summary such as ``"stale=1 adopted=2"``, or ``"nothing"``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from functools import partial

from board import BoardTask
from poolkeeper.errors import CapabilityError, LostRace, ProtocolError, TransientError
from store import queries, transitions
from store.models import RowState
from tasks import materialize
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")


def run(plane: Plane, board: str, now: float) -> str:
    with plane.store.session(readonly=True) as s:
        rows = [(r.id, r.task_id, r.run_id, r.state, r.attempt) for r in queries.live_rows_of_board(s, board)]
    running = {t.id: t for t in plane.board.running_tasks(board)}
    outcomes: Counter[str] = Counter()
    for row_id, task_id, run_id, state, attempt in rows:
        task = running.get(task_id)
        if state == RowState.RESULT.value or (task is not None and task.current_run_id == run_id):
            continue
        outcomes[_isolated(plane, row_id, partial(_stale, plane, row_id, state, attempt, now), now)] += 1
    for task in _orphans(plane, board, running.values()):
        outcome = _isolated(plane, None, partial(_adopt, plane, task, now), now)
        outcomes[outcome] += 1
        if outcome == "no_free_ordinal":
            break
    outcomes.pop("lost_race", None)
    outcomes.pop("no_free_ordinal", None)
    return " ".join(f"{k}={v}" for k, v in sorted(outcomes.items())) or "nothing"


def _stale(plane: Plane, row_id: int, state: str, attempt: int, now: float) -> str:
    with plane.store.session() as s:
        transitions.settle(s, row_id, RowState.STALE, expect_state=state, expect_attempt=attempt, now=now)
    return "stale"


def _orphans(plane: Plane, board: str, running: Iterable[BoardTask]) -> list[BoardTask]:
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
        t
        for t in pool
        if (t.id, t.current_run_id) not in known
        and not plane.coord.is_pending(
            "materialize",
            materialize.claim_name({"board": t.board, "task_id": t.id, "run_id": t.current_run_id}),
        )
    ]


def _adopt(plane: Plane, task: BoardTask, now: float) -> str:
    assert task.current_run_id is not None
    with plane.store.session(readonly=True) as s:
        free = queries.free_ordinals(s, plane.settings.pool_size)
    ordinal = next((o for o in free if plane.coord.reserve(o)), None)
    if ordinal is None:
        return "no_free_ordinal"
    try:
        try:
            payload = materialize.build_payload(task, task.current_run_id)
        except CapabilityError as err:
            return materialize.park(plane, task, task.current_run_id, str(err))
        with plane.store.session() as s:
            transitions.add_run(
                s,
                board=task.board,
                task_id=task.id,
                run_id=task.current_run_id,
                ordinal=ordinal,
                payload=payload,
                pool_size=plane.settings.pool_size,
                now=now,
            )
        return "adopted"
    finally:
        plane.coord.release(ordinal)


def _isolated(plane: Plane, row_id: int | None, step: Callable[[], str], now: float) -> str:
    """One row or task: its failure is its own, and the loop goes on."""
    try:
        return step()
    except LostRace:
        return "lost_race"
    except (TransientError, ProtocolError) as err:
        log.info("reconcile: %s: deferred to the next tick: %s", row_id or "adopt", err)
        return "deferred"
    except Exception as err:
        log.error("reconcile: row %s: %s: %s", row_id, type(err).__name__, err)
        if row_id is not None:
            try:
                with plane.store.session() as s:
                    transitions.record_failure(
                        s, row_id, f"reconcile: {type(err).__name__}: {err}", settings=plane.settings, now=now
                    )
            except Exception:  # the store is failing too: next tick
                pass
        return "failed"

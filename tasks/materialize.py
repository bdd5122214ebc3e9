"""Materialize claim (and dispatch, which makes the claims).

Dispatch claims at most as many ready tasks as there are free, unreserved
ordinals, reserving one ordinal per claim. Storage faults are absorbed (the
next tick tries again); anything else is a programming error (the board API
changed) and surfaces loudly.

Materialize turns one claim into exactly one ``assigned`` row on its reserved
ordinal, on evidence from the board:
- the task vanished, or its run is no longer the claimed one: nothing;
- the task left the pool's lane, or has no payload we may build: a
  capability failure of the run itself, so park exactly that run;
- the run already has a row: nothing (an identical duplicate);
- else add the row. A pool-side failure (ordinal taken, store busy) changes
  nothing on the board: the claim is left to reconcile, which adopts it.
Returns: ``"added"``, ``"duplicate"``, ``"parked"``, ``"vanished"`` or ``"moved_on"``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from board import BoardTask, TaskStatus
from board import Claim as BoardClaim
from poolkeeper import validate
from poolkeeper.errors import CapabilityError, InvalidInput, TransientError
from store import queries, transitions
from tasks.plane import Plane

log = logging.getLogger("poolkeeper.maintenance")
Claim = dict[str, Any]  # {"board", "task_id", "run_id", "ordinal"}: JSON in a message


def claim_name(claim: Claim) -> str:
    return f"{claim['board']}:{claim['task_id']}:{claim['run_id']}"


def build_payload(task: BoardTask, run_id: int) -> dict[str, Any]:
    """What the pool worker receives. A body holding a JSON object is passed on as ``input``."""
    payload: dict[str, Any] = {
        "board": task.board,
        "task_id": task.id,
        "run_id": run_id,
        "title": task.title,
        "body": task.body,
    }
    if task.body.lstrip().startswith("{"):
        try:
            payload["input"] = json.loads(task.body)
        except ValueError as err:
            raise CapabilityError(f"task body looks like JSON but is not: {err}") from None
    try:
        validate.document("payload", payload)
    except InvalidInput as err:
        raise CapabilityError(f"cannot build a payload: {err}") from None
    return payload


def dispatch(plane: Plane) -> list[Claim]:
    """Claim ready tasks for the free ordinals; returns the claims, each with its ordinal."""
    try:
        with plane.store.session(readonly=True) as s:
            free = queries.free_ordinals(s, plane.settings.pool_size)
        reserved = [o for o in free if plane.coord.reserve(o)]
    except TransientError as err:
        log.warning("dispatch: store or redis busy, next tick: %s", err)
        return []
    if not reserved:
        return []
    claims: list[BoardClaim] = []
    try:
        claims = plane.board.claim_ready(
            len(reserved), assignee=plane.settings.assignee, lane=plane.settings.lane
        )
    except TransientError as err:
        log.warning("dispatch: board busy, next tick: %s", err)
    finally:  # ordinals no claim took: all of them when the board failed (a bug still surfaces)
        for ordinal in reserved[len(claims) :]:
            plane.coord.release(ordinal)
    return [
        {"board": c.board, "task_id": c.task_id, "run_id": c.run_id, "ordinal": o}
        for c, o in zip(claims, reserved, strict=False)
    ]


def run(plane: Plane, claim: Claim, now: float) -> str:
    try:
        return _materialize(plane, claim, now)
    finally:
        plane.coord.release(int(claim["ordinal"]))


def _materialize(plane: Plane, claim: Claim, now: float) -> str:
    board, task_id, run_id = claim["board"], claim["task_id"], int(claim["run_id"])
    task = plane.board.get_task(board, task_id)
    if task is None:
        return "vanished"
    if task.current_run_id != run_id or task.status is not TaskStatus.RUNNING:
        return "moved_on"
    try:
        if task.lane != plane.settings.lane:
            raise CapabilityError(f"task left the pool's lane (now {task.lane!r})")
        payload = build_payload(task, run_id)
    except CapabilityError as err:
        return park(plane, task, run_id, str(err))
    with plane.store.session() as s:
        if queries.has_run(s, board, task_id, run_id):
            return "duplicate"
        transitions.add_run(
            s,
            board=board,
            task_id=task_id,
            run_id=run_id,
            ordinal=int(claim["ordinal"]),
            payload=payload,
            pool_size=plane.settings.pool_size,
            now=now,
        )
    return "added"


def park(plane: Plane, task: BoardTask, run_id: int, reason: str) -> str:
    """A capability failure: park exactly that run. A failed park is transient (raises)."""
    parked = plane.board.block_task(task.board, task.id, reason, "capability", run_id)
    return "parked" if parked else "moved_on"

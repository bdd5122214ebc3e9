"""The pool's numbers in one place: ``poolctl status --json`` prints them, the console shows them.

``store.numbers.read`` reads the store's part, as it does for ``/v1/status`` and the
store gauges of ``/metrics``, so none of them can disagree: rows by state, ordinals
(free, held by a healthy live row, held by a quarantined one), the oldest
``lease_failed`` row, live child executions, audit events written, each ordinal's last
worker call, what it holds and its state (``polling``, ``busy``, or ``gone`` when it has
had no call for longer than a lease), the ``assigned`` rows that have waited longer than
a lease, whether dispatch is paused (and which boards are, each on its own); then board
tasks by status, and from Redis each pass's last scan, beat liveness, the queue depth and
the Celery workers and beats by their beacons
(``tasks.liveness``; ``None`` when Redis does not answer).

A dependency that does not answer leaves its part ``None`` and names the error under
``unknown`` (``{"board": ..., "redis": ...}``): the rest is still read and shown, and
``poolctl status`` exits 0, so a monitoring script can tell what is wrong. The store is the
status itself: when it does not answer, there is nothing to show and the error is the answer.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from board import Board, BoardTask
from core.errors import PoolError
from core.settings import Settings
from store import PoolStore, numbers, pause
from store.models import LIVE_STATES, TERMINAL_STATES, EventKind
from tasks import liveness


def redis_reader(settings: Settings) -> tuple[redis.Redis | None, str]:
    """A short-timeout client for ``snapshot``, or None and why (a URL redis-py cannot take)."""
    try:
        return liveness.client_for(settings), ""
    except ValueError as err:
        return None, f"POOL_REDIS_URL: {err}"


def snapshot(
    store: PoolStore,
    board: Board,
    settings: Settings,
    client: redis.Redis | None,
    now: float,
    *,
    redis_error: str = "",
) -> dict[str, Any]:
    with store.session(readonly=True) as s:
        found = numbers.read(s, store.pool_size)
    try:
        board.require_schema()  # the board's own check: away, refusing, or not set up (one line)
        board_counts: dict[str, int] | None = board.counts_by_status()
        board_error = ""
    except PoolError as err:  # away, busy or refusing: a bug in the backend still surfaces
        board_counts, board_error = None, f"{type(err).__name__}: {err}"
    plane = liveness.read(client, settings, now, error=redis_error)
    parts = (("board", board_error), ("redis", plane.error))
    oldest = found.oldest_lease_failed_at
    return {
        "rows": found.rows,
        "pool_size": found.pool_size,
        "free_ordinals": found.free_ordinals,
        "oldest_lease_failed_seconds": None if oldest is None else round(now - oldest, 1),
        "quarantined": found.quarantined,
        "held_by_quarantined": found.held_by_quarantined,
        "ordinals": found.ordinals,
        "live_children": found.live_children,
        "audit_events": found.audit_events,
        "dispatch": dispatch_view(found.dispatch, found.paused_boards, now),
        **presence_view(found, now, store.lease_seconds),
        "board": board_counts,
        "board_error": board_error,
        **plane.as_json(now),
        "unknown": {part: error for part, error in parts if error},
    }


def presence_view(found: numbers.PoolNumbers, now: float, lease_seconds: float) -> dict[str, Any]:
    """Worker presence as plain values: per ordinal its last call, what it holds and its state,
    and what waits longer than a lease."""
    states = found.worker_states(now, lease_seconds)
    return {
        "presence": [
            {
                "ordinal": p.ordinal,
                "owner": p.owner,
                "call": p.call,
                "at": p.at,
                "age_seconds": None if p.at is None else round(now - p.at, 1),
                "state": states[p.ordinal].value,
                "holds": _holds(found.held.get(p.ordinal)),
            }
            for p in found.presence
        ],
        "ordinals_without_worker": found.without_worker(now, lease_seconds),
        "waiting_assigned": [
            {"id": w.id, "ordinal": w.ordinal, "waited_seconds": round(now - w.since, 1)}
            for w in found.waiting_assigned(now, lease_seconds)
        ],
        "lease_seconds": lease_seconds,
    }


def dispatch_view(d: pause.Pause, boards: dict[str, pause.Pause], now: float) -> dict[str, Any]:
    """Whether dispatch is paused (no new claims), by whom, why and for how long; and under
    ``boards``, each board paused on its own (by name) the same way."""
    return {**_pause_view(d, now), "boards": [{"board": b, **_pause_view(p, now)} for b, p in boards.items()]}


def _pause_view(d: pause.Pause, now: float) -> dict[str, Any]:
    return {
        "paused": d.paused,
        "reason": d.reason,
        "by": d.actor,
        "since": d.since,
        "since_seconds": None if d.since is None else round(now - d.since, 1),
    }


def _holds(h: Any) -> dict[str, Any] | None:
    if h is None:
        return None
    return {"row": h.id, "board": h.board, "task_id": h.task_id, "run_id": h.run_id, "state": h.state}


def row_view(r: Any) -> dict[str, Any]:
    """A row as plain values (read inside its transaction): the console's, and `poolctl rows`' fields."""
    return {
        "id": r.id,
        "board": r.board,
        "task_id": r.task_id,
        "run_id": r.run_id,
        "ordinal": r.ordinal,
        "state": r.state,
        "attempt": r.attempt,
        "fence": r.fence,
        "owner": r.owner,
        "lease_until": r.lease_until,
        "payload_digest": r.payload_digest,
        "result_digest": r.result_digest,
        "created_at": r.created_at,
        "updated_at": r.updated_at,
        "failures": r.failures,
        "last_error": r.last_error,
        "next_attempt_at": r.next_attempt_at,
        "quarantined": bool(r.quarantined),
        "live": r.state in {s.value for s in LIVE_STATES},
        "terminal": r.state in {s.value for s in TERMINAL_STATES},
    }


def row_detail(row: Any, history: list[dict[str, Any]], task: BoardTask | None) -> dict[str, Any]:
    """What a row ran and what came of it: its payload, its result (exit code, output tails), its times.

    A terminal row's payload and result are compacted away (invariant 8): ``compacted`` says so,
    and the result shown is then the board task's, while the task is still on the row's run.
    Times are seconds from the audit trail: ``wait`` claim to first grant, ``run`` last grant
    to result, ``total`` claim to result (or to the row's end); None where a step is missing.
    """
    payload = json.loads(row.payload) if row.payload else None
    result = json.loads(row.result) if row.result else None
    compacted = row.state in {s.value for s in TERMINAL_STATES}
    if result is None and task is not None and task.current_run_id == row.run_id:
        result = task.result
    grants = [e["at"] for e in history if e["kind"] == EventKind.GRANT]
    results = [e["at"] for e in history if e["kind"] == EventKind.RESULT]
    ended = results[-1] if results else (row.updated_at if compacted else None)
    return {
        "payload": payload,
        "compacted": compacted,
        "result": result,
        "wait_seconds": grants[0] - row.created_at if grants else None,
        "run_seconds": results[-1] - grants[-1] if grants and results else None,
        "total_seconds": ended - row.created_at if ended is not None else None,
    }

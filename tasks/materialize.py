"""Materialize claim (its scanner is dispatch, which makes the claims).

Dispatch (one at a time, plane-wide) claims at most as many ready tasks as
there are free, unreserved ordinals, reserving one ordinal per claim; while an
operator has paused it (``store.pause``, drain mode) it claims nothing, said once
per pause, and every run already claimed goes on as ever; from a board paused on its
own it claims nothing (the board skips it), from the others as ever. Storage
faults are absorbed (the next tick tries again); anything else is a
programming error (the board API changed) and surfaces loudly. Reconcile
hands over the orphaned runs it finds through ``hand_over`` too, so there is
one way onto an ordinal.

Materialize turns one claim into exactly one ``assigned`` row on its reserved
ordinal, on evidence from the board:
- the task (from ``get_task``, or the board's listing when it cannot be read
  alone) vanished, or its run is no longer the claimed one: nothing;
- the task left the pool's lane, or has no payload we may build: a
  capability failure of the run itself, so park exactly that run;
- the run already has a row that is not terminal: nothing (a duplicate); a
  terminal one means the board reused a run id: refused (``DuplicateIdentity``);
- else add the row on the reserved ordinal, with when the board says the task turned
  ready (its wait, ``poolkeeper_task_wait_seconds``, is observed here, where both ends
  are known); if a row holds it (the reservation was lost), on another free one; with
  none free the claim waits (``waits``) for the next free ordinal, which dispatch hands
  to waiting claims before claiming anything.
  Nothing changes on the board for a pool-side failure: a transient one (store
  or board busy, no ordinal free) is retried with the ordinal still reserved;
  when the retries run out the claim is left to reconcile, which hands it
  over again.
Returns: ``added``, ``duplicate``, ``parked``, ``waits``, ``vanished`` or ``moved_on``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

from board import BoardTask, TaskStatus
from core import tracing, validate
from core.db import is_transient
from core.errors import CapabilityError, InvalidInput, OrdinalTaken, TransientError
from store import audit, pause, presence, queries, transitions
from store.models import TERMINAL_STATES
from tasks import failures
from tasks.declaration import Lock, Outcome, Pass, Submit
from tasks.plane import Plane

# {"board", "task_id", "run_id", "ordinal"}: JSON in a message. No snapshot of the task rides
# along: a claim retried or delayed would trust it after the run moved on (cancelled,
# reassigned into a new run), so materialize always reads the board afresh (``read``).
Claim = dict[str, Any]


def claim_name(claim: Claim) -> str:
    return f"{claim['board']}:{claim['task_id']}:{claim['run_id']}"


def build_payload(task: BoardTask, run_id: int) -> dict[str, Any]:
    """What the pool worker receives (``validate.run_payload``); a failure is the run's own."""
    try:
        return validate.run_payload(
            board=task.board, task_id=task.id, run_id=run_id, title=task.title, body=task.body
        )
    except InvalidInput as err:
        raise CapabilityError(f"cannot build a payload: {err}") from None


def reserve_free(plane: Plane, at_most: int, now: float, *, staffed_only: bool = False) -> list[int]:
    """Reserve up to ``at_most`` ordinals that hold no live row and no other reservation.

    Ordinals whose worker called within a lease come first; ``staffed_only`` takes
    only those (dispatch: a new claim on an ordinal no worker serves would sit
    ``assigned`` while the board says it runs). This process holds them (its keeper
    renews them) until ``hand_over`` queues or releases them: a dispatcher that dies
    on the way frees them within a hold.
    """
    if at_most <= 0:
        return []
    n = plane.settings.pool_size
    with plane.store.session(readonly=True) as s:
        free = queries.free_ordinals(s, n)
        staffed = presence.staffed(s, n, now - plane.settings.lease_seconds)
    first = [o for o in free if o in staffed]
    return _reserve(plane, first if staffed_only else first + [o for o in free if o not in staffed], at_most)


def _reserve(plane: Plane, candidates: list[int], at_most: int) -> list[int]:
    reserved: list[int] = []
    rest = candidates
    while rest and len(reserved) < at_most:  # one round trip for as many as are still wanted
        want = at_most - len(reserved)
        reserved += plane.coord.reserve(rest[:want])
        rest = rest[want:]
    return reserved


def hand_over(plane: Plane, runs: Sequence[Claim], ordinals: list[int], submit: Submit) -> list[Claim]:
    """Submit one claim per run on its reserved ordinal; release every ordinal no claim took.

    A taken ordinal's reservation then stands for its claim in the queue (the worker that
    receives the claim holds it, ``tasks.celery``), until materialize releases it. Returns
    the claims submitted (one already pending is left to it).
    """
    claims = [{**run, "ordinal": o} for run, o in zip(runs, ordinals, strict=False)]
    sent: list[Claim] = []
    try:
        sent = submit(PASS.name, claims)
        plane.coord.queue_reserved(c["ordinal"] for c in sent)
    finally:  # a claim already pending (or a failed enqueue) leaves its ordinal free
        taken = {c["ordinal"] for c in sent}
        plane.coord.release(o for o in ordinals if o not in taken)
    return sent


def dispatch(plane: Plane, now: float, submit: Submit) -> int:
    """Claim ready tasks for the free ordinals; one dispatch at a time, plane-wide.

    A slow or locked board then holds one worker, not all. Each round that has a free
    ordinal takes the event flag (``tasks.events``) before it claims, so a task added or an
    ordinal freed while it runs makes the dispatch go round again instead of waiting for a
    tick; it looks once more after letting go of its lock, since a dispatch that found the
    lock held left its work to the holder. A round with no free ordinal ends it and leaves
    the flag standing: adds then send nothing more until an ordinal is freed (whose event
    always sends one) or the flag lapses. Past ``MAX_ROUNDS`` the rest goes to a fresh
    message, so a stream of adds never holds one worker for long.
    """
    handed = rounds = 0
    while rounds < MAX_ROUNDS:
        [token] = plane.coord.lock_many(["dispatch"])
        if token is None:
            return handed  # the holder goes round again for what was asked meanwhile
        try:
            while rounds < MAX_ROUNDS:
                rounds += 1
                free, n = _claim_round(plane, now, submit)
                handed += n
                if not free or not plane.events.asked(PASS.name):
                    break
        finally:
            plane.coord.unlock_many({"dispatch": token})
        if not free or not plane.events.asked(PASS.name):
            return handed
    plane.events.scan_due(PASS.name, force=True)  # still asked for: a fresh message goes on
    return handed


MAX_ROUNDS = 32


def _claim_round(plane: Plane, now: float, submit: Submit) -> tuple[bool, int]:
    """One claim for the free, staffed ordinals: (whether any was free, claims handed over).

    Waiting claims (``wait``) are served first, paused or not: they are claimed already.
    """
    try:
        with plane.store.session(readonly=True) as s:
            held, paused_boards = pause.read(s), sorted(pause.boards(s))
        reserved = reserve_free(plane, plane.settings.pool_size, now, staffed_only=True)
    except TransientError as err:
        failures.reporter.once("dispatch", "all", f"store or redis busy, next tick: {err}")
        return False, 0
    if not reserved:  # no free ordinal with a worker: the flag stays for the next freed one
        return False, 0
    plane.events.take(PASS.name)  # what is asked for from here on is the next round's
    asked = time.time()
    try:
        served, reserved = _serve_waiting(plane, reserved, submit)
    except BaseException:  # what no claim took goes back (hand_over freed its own)
        plane.coord.release(reserved)
        raise
    if held.paused:  # once per pause: the reporter forgets it when a claim succeeds again
        plane.coord.release(reserved)
        why = f"paused by {held.actor}: {held.reason}; claiming nothing until `poolctl resume`"
        failures.reporter.once("dispatch", "all", why, logging.INFO)
        return False, served
    if not reserved:
        return True, served
    try:
        claims = plane.board.claim_ready(
            len(reserved),
            assignee=plane.settings.assignee,
            lane=plane.settings.lane,
            skip_boards=paused_boards,
        )
    except TransientError as err:
        failures.reporter.once("dispatch", "all", f"board busy, next tick: {err}")
        claims = []
    except BaseException:  # a bug surfaces loudly, and frees what it reserved
        plane.coord.release(reserved)
        raise
    else:
        failures.reporter.succeeded("dispatch", "all")  # the next busy tick is news again
    runs = [{"board": c.board, "task_id": c.task_id, "run_id": c.run_id} for c in claims]
    if not runs or not tracing.enabled():
        return True, served + len(hand_over(plane, runs, reserved, submit))
    # The round is a trace of its own, which its message's headers carry on; each claim is the
    # root of its run's trace (linked to the round), which the claim carries on to its row.
    with tracing.span("dispatch", None, {"pool.claims": len(runs)}, start=asked):
        for r in runs:
            r["traceparent"] = tracing.root("claim", asked, _attributes(r), links=[tracing.current()])
        return True, served + len(hand_over(plane, runs, reserved, submit))


def _attributes(claim: Claim) -> dict[str, Any]:
    return {"pool.board": claim["board"], "pool.task_id": claim["task_id"], "pool.run_id": claim["run_id"]}


def _serve_waiting(plane: Plane, reserved: list[int], submit: Submit) -> tuple[int, list[int]]:
    """Waiting claims first, on the first reserved ordinals: (claims handed over, ordinals left).

    One still pending (its own message has not finished: it may have just begun to wait)
    waits again, in its place; a body that is not a claim is dropped, said once.
    """
    try:
        bodies = plane.coord.take_waiting(len(reserved))
    except TransientError as err:
        failures.reporter.once("dispatch", "waiting", f"waiting claims unread this round: {err}")
        return 0, reserved
    waiting = [c for c in map(_claim_of, bodies) if c is not None]
    first, rest = reserved[: len(waiting)], reserved[len(waiting) :]
    try:
        sent = {claim_name(c) for c in hand_over(plane, waiting, first, submit)}
    except BaseException:
        _wait_again(plane, waiting)
        raise
    _wait_again(plane, [c for c in waiting if claim_name(c) not in sent])
    return len(sent), rest


def _claim_of(body: str) -> Claim | None:
    try:
        claim = json.loads(body)
        claim_name(claim)
    except (ValueError, TypeError, KeyError):
        failures.reporter.once(
            "dispatch", "waiting", f"dropped a waiting claim that is not one: {body[:200]!r}"
        )
        return None
    return claim if isinstance(claim, dict) else None


def _wait_again(plane: Plane, claims: list[Claim]) -> None:
    with suppress(TransientError):  # lost, it is a claimed run with no row: reconcile's
        plane.coord.wait_for_ordinal(_bodies(claims))


def run(plane: Plane, claim: Claim, now: float) -> Outcome:
    """One claim; its reservation is released on every way out but a transient failure.

    A transient failure is retried with the same claim, so its ordinal stays promised to
    it (the process holding the claim's message renews the reservation; whoever receives
    the retry takes it over): dispatch cannot hand that ordinal to another claim meanwhile.
    When the retries run out, ``failures.give_up`` releases it.
    """
    retried = False
    try:
        with tracing.span("materialize", claim.get("traceparent"), _attributes(claim)):
            return _materialize(plane, claim, now)
    except Exception as err:
        retried = is_transient(err)
        raise
    finally:
        if not retried:
            plane.coord.release([ordinal(claim)])


def ordinal(claim: Claim) -> int:
    """The ordinal reserved for the claim: held while it runs or retries, then released."""
    return int(claim["ordinal"])


def _materialize(plane: Plane, claim: Claim, now: float) -> Outcome:
    board, task_id, run_id = claim["board"], claim["task_id"], int(claim["run_id"])
    task = read(plane, board, task_id)
    if task is None:
        return Outcome.VANISHED
    if task.current_run_id != run_id or task.status is not TaskStatus.RUNNING:
        return Outcome.MOVED_ON
    try:
        if task.lane != plane.settings.lane:
            raise CapabilityError(f"task left the pool's lane (now {task.lane!r})")
        payload = build_payload(task, run_id)
    except CapabilityError as err:
        return park(plane, task, run_id, str(err))
    outcome = _add_anywhere(plane, claim, payload, now, task.ready_at)
    if outcome is Outcome.ADDED and task.ready_at is not None:  # once: a retry finds it a duplicate
        from tasks import metrics  # prometheus_client: not for `poolctl status`, which reads PASSES

        metrics.TASK_WAIT.observe(max(0.0, now - task.ready_at))
    return outcome


def _add_anywhere(
    plane: Plane, claim: Claim, payload: dict[str, Any], now: float, ready_at: float | None
) -> Outcome:
    """The claim's row on its reserved ordinal, else on any free one, else the claim waits."""
    try:
        return add(plane, claim, ordinal(claim), payload, now, ready_at)
    except OrdinalTaken:
        # A row holds the ordinal: the reservation was lost (Redis restarted, a dead holder's
        # lapsed, a duplicate gave it back). Any free ordinal will do. The store's unique
        # index, not the reservation, keeps one live row per ordinal.
        others = reserve_free(plane, 1, now)
        if not others:
            # It waits for the next free ordinal, whichever frees first: dispatch serves waiting
            # claims before it claims anything new (a reservation lost with Redis, or with a
            # holder that died, would otherwise let new claims take every ordinal that frees).
            wait(plane, [claim])
            return Outcome.WAITS
        try:
            return add(plane, claim, others[0], payload, now, ready_at)
        finally:
            plane.coord.release(others)


def wait(plane: Plane, claims: Sequence[Claim]) -> None:
    """Claims with no ordinal: dispatch hands them the next free ones first (``take_waiting``).

    A claim lost from there (Redis restarted) is a claimed run with no row, which reconcile
    hands over again.
    """
    if not claims:
        return
    plane.coord.wait_for_ordinal(_bodies(claims))
    plane.events.scan_due(PASS.name, force=True)  # an ordinal freed meanwhile serves it at once


def _bodies(claims: Sequence[Claim]) -> dict[str, str]:
    return {claim_name(c): json.dumps({k: v for k, v in c.items() if k != "ordinal"}) for c in claims}


def add(
    plane: Plane, claim: Claim, on: int, payload: dict[str, Any], now: float, ready_at: float | None
) -> Outcome:
    """The claim's row on ordinal ``on``, in one short transaction (``OrdinalTaken`` if it is held)."""
    board, task_id, run_id = claim["board"], claim["task_id"], int(claim["run_id"])
    with plane.store.session() as s:
        state = queries.run_state(s, board, task_id, run_id)
        if state is not None and state not in TERMINAL_STATES:
            return Outcome.DUPLICATE
        # A terminal row for a claimed run is a reused run id, not a duplicate: add_run refuses it.
        transitions.add_run(
            s,
            board=board,
            task_id=task_id,
            run_id=run_id,
            ordinal=on,
            payload=payload,
            pool_size=plane.settings.pool_size,
            now=now,
            actor=audit.by_pass(PASS.name),
            # the run's root: its claim's span (or, for a claim reconcile handed over, this one)
            traceparent=tracing.valid(claim.get("traceparent")) or tracing.current(),
            ready_at=ready_at,
        )
    return Outcome.ADDED


def read(plane: Plane, board: str, task_id: str) -> BoardTask | None:
    """The claimed task, from ``get_task``; one the board cannot read alone, from its listing.

    A task that ``get_task`` fails on (corrupt data, not a busy board) but that the board
    lists as running still gets its row, which the row passes quarantine where an operator
    sees it, instead of a claimed run that no row stands for.
    """
    try:
        return plane.board.get_task(board, task_id)
    except Exception as err:
        if is_transient(err):
            raise
        listed = next((t for t in plane.board.running_tasks(board) if t.id == task_id), None)
        if listed is None:
            raise
        return listed


def park(plane: Plane, task: BoardTask, run_id: int, reason: str) -> Outcome:
    """A capability failure: park exactly that run. A failed park is transient (raises)."""
    parked = plane.board.block_task(task.board, task.id, reason, "capability", run_id)
    return Outcome.PARKED if parked else Outcome.MOVED_ON


PASS = Pass(
    name="materialize",
    lock=Lock.OWN,
    interval=lambda s: s.tick_seconds,
    find=dispatch,
    run=run,
    key_name=claim_name,
    log_ids=lambda claim: {k: claim.get(k) for k in ("task_id", "run_id", "ordinal")},
    reserves=ordinal,
)

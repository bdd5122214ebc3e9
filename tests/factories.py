"""Shared test helpers: the fixed clock, row and envelope factories, reading a row back, driving a pass.

Test modules import these from here, never from each other.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from sqlalchemy import text

from board import Board
from core.settings import Settings
from poolkeeper.embedded import ServeProc
from poolkeeper.workerhost import client
from store import Offer, PoolStore, queries
from tasks import registry, runner, scan
from tasks.plane import Plane

NOW = 1_800_000_000.0  # the fixed clock of the unit tests
OWNER = "w-1"  # the worker instance the tests offer as, unless a test restarts it
RowFactory = Callable[..., int]  # the ``make_row`` fixture: a row in a given state, its id back


def given_running(store: PoolStore, ordinal: int = 0, task_id: str = "t1", owner: str = OWNER) -> Offer:
    store.add_run(board="b", task_id=task_id, run_id=1, ordinal=ordinal, payload={"title": task_id}, now=NOW)
    offer = store.offer(ordinal, owner=owner, now=NOW)
    assert offer is not None
    return offer


@contextmanager
def serving(settings: Settings, tmp: Path, *, secret: str, lease_seconds: float) -> Iterator[ServeProc]:
    """A real ``poolctl serve`` over the test's store, with short leases, stopped afterwards."""
    proc = ServeProc(replace(settings, lease_seconds=lease_seconds).env(), tmp, secret=secret)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def envelope(offer: Offer, delivery_id: str = "d1", **over: Any) -> dict[str, Any]:
    """The client's envelope, with a fixed delivery id so a test can replay it."""
    return client.envelope(offer, delivery_id=delivery_id, **over)


def grant(offer: Offer, **over: Any) -> dict[str, Any]:
    """The holder's identity, as ``register_child`` and ``child_vanished`` take it."""
    held = {"row_id": offer.row_id, "attempt": offer.attempt, "fence": offer.fence, "owner": offer.owner}
    return {**held, **over}


def row_state(store: PoolStore, row_id: int) -> dict[str, Any]:
    with store.session(readonly=True) as s:
        row = s.execute(text("SELECT * FROM assignments WHERE id = :id"), {"id": row_id}).mappings().first()
    assert row is not None, f"row {row_id} is gone"
    return dict(row)


def scanned(plane: Plane, pass_name: str, now: float = NOW) -> dict[str, list[Any]]:
    """Run one pass's scanner: the keys it submitted, by the pass they were submitted to."""
    queued: dict[str, list[Any]] = {}

    def collect(name: str, keys: Sequence[Any]) -> None:
        queued.setdefault(name, []).extend(keys)

    scan.scan(plane, pass_name, now, collect)
    for name, keys in queued.items():  # submitted means pending: clear, as a worker would
        plane.coord.clear_pending(name, [registry.get(name).key_name(k) for k in keys])
    return {name: keys for name, keys in queued.items() if keys}


# --- driving the passes (tests/passes/) ---------------------------------------------


def dispatched(plane: Plane) -> list[dict[str, Any]]:
    """The claims dispatch handed to materialize this tick."""
    return scanned(plane, "materialize").get("materialize", [])


def claimed(plane: Plane, kanban: Board, n: int = 1, board: str = "b") -> list[int]:
    """Given n tasks claimed by dispatch and materialized: their row ids."""
    for i in range(n):
        kanban.add_task(board, f"task {i}", task_id=f"{board}{i}")
    for claim in scanned(plane, "materialize")["materialize"]:
        assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    with plane.store.session() as s:
        return [r.id for r in queries.rows(s)][-n:]


def claim_on_a_taken_ordinal(plane: Plane, kanban: Board, task_id: str) -> dict[str, Any]:
    """Every ordinal busy (3 rows), and a claim of ``task_id`` for the first row's ordinal, as one
    whose reservation was lost (Redis restarted) finds it."""
    rows = claimed(plane, kanban, n=3)
    kanban.add_task("b", task_id, task_id=task_id)
    [claim] = kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    taken = row_state(plane.store, rows[0])["ordinal"]
    return {"board": "b", "task_id": task_id, "run_id": claim.run_id, "ordinal": taken}


def running_row(plane: Plane, kanban: Board) -> int:
    """Given one claimed task whose row its ordinal's worker holds: the row id."""
    [row] = claimed(plane, kanban)
    ordinal = row_state(plane.store, row)["ordinal"]
    assert plane.store.offer(ordinal, owner=OWNER, now=NOW) is not None
    return row


def lease_failed_row(plane: Plane, kanban: Board) -> int:
    """Given a held row whose last attempt's lease ended: the row id."""
    row = running_row(plane, kanban)
    with plane.store.session() as s:
        s.execute(text("UPDATE assignments SET state='lease_failed', attempt=3 WHERE id=:i"), {"i": row})
    return row


def holder_envelope(store: PoolStore, row: int, delivery_id: str, **extra: Any) -> dict[str, Any]:
    """The envelope the row's current holder would send (``extra``: ``payload`` for a result)."""
    r = row_state(store, row)
    return {
        "delivery_id": delivery_id,
        "board": r["board"],
        "task_id": r["task_id"],
        "run_id": r["run_id"],
        "worker_ordinal": r["ordinal"],
        "attempt": r["attempt"],
        "fence": r["fence"],
        "payload_digest": r["payload_digest"],
        **extra,
    }


def deliver(plane: Plane, row: int, payload: dict[str, Any]) -> None:
    """The row's holder delivers ``payload`` as its result."""
    plane.store.accept_result(holder_envelope(plane.store, row, f"r{row}", payload=payload), now=NOW)


def one_worker_for_three_ordinals(store: PoolStore) -> None:
    """POOL_SIZE=3, runs on every ordinal, and one worker, on ordinal 0, that took its run."""
    for ordinal in range(3):
        store.add_run(board="b", task_id=f"t{ordinal}", run_id=1, ordinal=ordinal, payload={}, now=NOW)
    assert store.offer(0, owner=OWNER, now=NOW) is not None


class WithoutSearch:
    """A board backend that offers no search (``board.protocol.Searching`` is optional)."""

    def __init__(self, inner: Board) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        if name == "search_tasks":
            raise AttributeError(name)
        return getattr(self.inner, name)

"""Ordinals without a worker and runs waiting ``assigned``: in the status snapshot, /v1/status, the gauges."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

from board import Board
from core.settings import Settings
from poolkeeper.api import probes
from poolkeeper.cli import render
from poolkeeper.status import snapshot
from store import PoolStore
from tasks.collectors import StoreCollector
from tests.factories import NOW, OWNER, one_worker_for_three_ordinals

LEASE = 30.0  # the settings fixture's lease


def _text(renderable: Any, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_status_warns_of_ordinals_without_a_worker_and_runs_waiting_assigned(
    store: PoolStore, kanban: Board, settings: Settings
) -> None:
    """The issue's scene: one worker, POOL_SIZE=3; runs on ordinals 1 and 2 stay ``assigned``."""
    one_worker_for_three_ordinals(store)
    later = NOW + LEASE + 1
    grant = store.offer(0, owner=OWNER, now=later - 1)  # ordinal 0's worker is still there
    assert grant is not None

    data = snapshot(store, kanban, settings, None, later)
    assert data["ordinals_without_worker"] == [1, 2]
    assert [(w["ordinal"], w["waited_seconds"]) for w in data["waiting_assigned"]] == [(1, 31.0), (2, 31.0)]
    assert data["presence"][0] == {
        "ordinal": 0,
        "owner": OWNER,
        "call": "offer",
        "at": later - 1,
        "age_seconds": 1.0,
        "state": "busy",
        "holds": {"row": 1, "board": "b", "task_id": "t0", "run_id": 1, "state": "running"},
    }
    assert [p["state"] for p in data["presence"]] == ["busy", "gone", "gone"]
    shown = _text(render.status(data, store.pool_size))
    assert "ordinal 1 worker" in shown and "no worker for over a lease" in shown
    assert "assigned longer than a lease" in shown and "row 2 on ordinal 1" in shown

    early = snapshot(store, kanban, settings, None, NOW + 1)
    assert early["waiting_assigned"] == []


def test_v1_status_and_the_gauges_say_which_ordinals_have_no_worker(store: PoolStore) -> None:
    """They read the real clock: the runs were added a lease ago, only ordinal 0's worker calls."""
    then = time.time() - LEASE - 5
    for ordinal in range(3):
        store.add_run(board="b", task_id=f"t{ordinal}", run_id=1, ordinal=ordinal, payload={}, now=then)
    assert store.offer(0, owner=OWNER, now=time.time()) is not None

    status = probes.status(None, store)  # type: ignore[arg-type]  # the operator check is the router's
    assert status.ordinals_without_worker == [1, 2]
    assert status.waiting_assigned == [2, 3]
    assert status.worker_states == ["busy", "gone", "gone"]

    gauges = {m.name: m for m in StoreCollector(store).collect()}
    seen = {s.labels["ordinal"]: s.value for s in gauges["poolkeeper_ordinal_last_seen_seconds"].samples}
    assert set(seen) == {"0"} and 0 <= seen["0"] < 5
    assert gauges["poolkeeper_ordinals_without_worker"].samples[0].value == 2
    assert gauges["poolkeeper_assigned_over_lease_rows"].samples[0].value == 2
    assert gauges["poolkeeper_ordinals_busy"].samples[0].value == 1  # ordinal 0 runs its grant

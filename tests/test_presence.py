"""Issue 18's remaining findings: worker presence, logs, reconcile's order, CLI output, deploy files, beat.

Each test names its finding and failed on the code before its fix.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
from rich.console import Console

from board import Board
from core.errors import TransientError
from core.settings import Settings
from poolkeeper.cli import render
from poolkeeper.server import probes
from poolkeeper.status import snapshot
from store import PoolStore, numbers
from store.presence import EVERY_SECONDS
from tasks import plane, registry, runner, scan
from tasks.collectors import StoreCollector
from tasks.declaration import Outcome
from tasks.plane import Plane
from tests.factories import NOW, OWNER, envelope, scanned

LEASE = 30.0  # the settings fixture's lease


def _text(renderable: Any, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def _given_one_worker_for_three_ordinals(store: PoolStore) -> None:
    """POOL_SIZE=3, runs on every ordinal, and one worker, on ordinal 0, that took its run."""
    for ordinal in range(3):
        store.add_run(board="b", task_id=f"t{ordinal}", run_id=1, ordinal=ordinal, payload={}, now=NOW)
    assert store.offer(0, owner=OWNER, now=NOW) is not None


def _presence(store: PoolStore) -> list[tuple[int, str | None, str | None, float | None]]:
    with store.session(readonly=True) as s:
        return [(p.ordinal, p.owner, p.call, p.at) for p in numbers.read(s, store.pool_size).presence]


# --- finding 2: worker presence -------------------------------------------------------------


def test_each_ordinals_last_call_and_owner_are_kept(store: PoolStore) -> None:
    _given_one_worker_for_three_ordinals(store)
    assert _presence(store) == [(0, OWNER, "offer", NOW), (1, None, None, None), (2, None, None, None)]

    grant = store.offer(0, owner=OWNER, now=NOW + 10)
    assert grant is not None
    store.heartbeat(envelope(grant, "h1"), now=NOW + 20)
    assert _presence(store)[0] == (0, OWNER, "heartbeat", NOW + 20)

    store.accept_result({**envelope(grant, "r1"), "payload": {"status": "done"}}, now=NOW + 21)
    assert _presence(store)[0] == (0, OWNER, "result", NOW + 21)  # a result always writes


def test_presence_is_written_at_most_once_per_interval_per_ordinal(store: PoolStore) -> None:
    """An idle worker polls offer about once a second: most polls write nothing."""
    store.offer(1, owner="w-a", now=NOW)
    store.offer(1, owner="w-a", now=NOW + EVERY_SECONDS / 2)
    assert _presence(store)[1] == (1, "w-a", "offer", NOW)
    store.offer(1, owner="w-b", now=NOW + EVERY_SECONDS / 2)  # a restarted worker is news at once
    assert _presence(store)[1] == (1, "w-b", "offer", NOW + EVERY_SECONDS / 2)
    store.offer(1, owner="w-b", now=NOW + 2 * EVERY_SECONDS)
    assert _presence(store)[1] == (1, "w-b", "offer", NOW + 2 * EVERY_SECONDS)


def test_status_warns_of_ordinals_without_a_worker_and_runs_waiting_assigned(
    store: PoolStore, kanban: Board, settings: Settings
) -> None:
    """The issue's scene: one worker, POOL_SIZE=3; runs on ordinals 1 and 2 stay ``assigned``."""
    _given_one_worker_for_three_ordinals(store)
    later = NOW + LEASE + 1
    grant = store.offer(0, owner=OWNER, now=later - 1)  # ordinal 0's worker is still there
    assert grant is not None

    data = snapshot(store, kanban, settings, None, later)
    assert data["ordinals_without_worker"] == [1, 2]
    assert [(w["ordinal"], w["waited_seconds"]) for w in data["waiting_assigned"]] == [(1, 31.0), (2, 31.0)]
    assert data["presence"][0] == {"ordinal": 0, "owner": OWNER, "call": "offer", "age_seconds": 1.0}
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

    gauges = {m.name: m for m in StoreCollector(store).collect()}
    seen = {s.labels["ordinal"]: s.value for s in gauges["poolkeeper_ordinal_last_seen_seconds"].samples}
    assert set(seen) == {"0"} and 0 <= seen["0"] < 5
    assert gauges["poolkeeper_ordinals_without_worker"].samples[0].value == 2
    assert gauges["poolkeeper_assigned_over_lease_rows"].samples[0].value == 2


# --- findings 3 and 4: logs name the row, and say a repeated thing once --------------------


def test_a_batch_names_the_row_of_each_outcome_and_says_nothing_when_nothing_happened(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "poolkeeper")
    done = runner.BatchResult(registry.get("results"))
    done.finish(17, Outcome.FINALIZED)
    done.report()
    many = runner.BatchResult(registry.get("expire"))
    for row in range(1, 26):
        many.finish(row, Outcome.REOFFERED)
    many.report()
    quiet = runner.BatchResult(registry.get("results"))
    quiet.finish(18, Outcome.LOCK_BUSY)
    quiet.finish(19, Outcome.LOST_RACE)
    quiet.report()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "results 17: finalized",
        "expire " + ", ".join(map(str, range(1, 21))) + " and 5 more: reoffered",
    ]


def test_beat_does_not_log_a_line_per_due_task(caplog: pytest.LogCaptureFixture) -> None:
    from tasks import celery

    celery._quiet_celery()
    caplog.set_level(logging.INFO, "celery.beat")
    beat = logging.getLogger("celery.beat")
    beat.info("Scheduler: Sending due task %s (%s)", "poolkeeper-expire", "poolkeeper.scan")
    beat.info("beat: Starting...")
    assert [r.getMessage() for r in caplog.records] == ["beat: Starting..."]


def test_a_scan_skipped_on_every_tick_is_logged_once_per_detail(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from tasks import celery

    def busy(*_: Any) -> int:
        raise TransientError("pool store: database is locked")

    monkeypatch.setattr(plane, "current", lambda: None)
    monkeypatch.setattr(scan, "scan", busy)
    caplog.set_level(logging.INFO, "poolkeeper")
    for _ in range(3):
        celery.scan_pass.run("expire")
    assert [r.getMessage() for r in caplog.records] == [
        "expire scan: skipped this tick: TransientError: pool store: database is locked"
    ]


# --- finding 6: a failing board registry never keeps a moved-on run live -------------------


def test_reconcile_releases_moved_on_rows_while_the_board_registry_fails(
    plane: Plane, kanban: Board, monkeypatch: pytest.MonkeyPatch
) -> None:
    kanban.add_task("b", "task", task_id="t1")
    [claim] = scanned(plane, "materialize")["materialize"]
    assert runner.run_key(plane, "materialize", claim, NOW) == "added"
    kanban.reassign_task("b", "t1", assignee="alice", lane="humans")  # the run moved on

    def registry_down(**_: Any) -> list[str]:
        raise TransientError("board: registry busy")

    monkeypatch.setattr(plane.board, "list_boards", registry_down)
    queued = scanned(plane, "reconcile")
    assert queued["reconcile"] == [1]
    assert runner.run_key(plane, "reconcile", 1, NOW) == "stale"

"""What the plane logs: a batch names the row of each outcome, and a repeated thing is said once."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from core.errors import TransientError
from tasks import plane, registry, runner, scan
from tasks.declaration import Outcome


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

    def busy(*_: Any, **__: Any) -> int:
        raise TransientError("pool store: database is locked")

    monkeypatch.setattr(plane, "current", lambda: None)
    monkeypatch.setattr(scan, "scan", busy)
    caplog.set_level(logging.INFO, "poolkeeper")
    for _ in range(3):
        celery.scan_pass.run("expire")
    assert [r.getMessage() for r in caplog.records] == [
        "expire scan: skipped this tick: TransientError: pool store: database is locked"
    ]

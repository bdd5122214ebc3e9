"""The gauges the alert rules need beyond what the exporters served: the oldest ``lease_failed`` row's age
and each pass's lateness, both as ``poolctl status`` judges them (issue 19, item 7)."""

from __future__ import annotations

import time
from typing import Any

import fakeredis
import pytest

from core.settings import Settings
from store import PoolStore
from store.models import RowState
from tasks import collectors, registry
from tasks.plane import RedisCoordination
from tests.factories import NOW


def test_the_oldest_lease_failed_row_has_a_gauge_of_its_age(store: PoolStore, make_row: Any) -> None:
    def gauge() -> float:
        found = {m.name: m for m in collectors.StoreCollector(store).collect()}
        return float(found["poolkeeper_oldest_lease_failed_seconds"].samples[0].value)

    assert gauge() == 0, "none waiting"
    make_row(RowState.LEASE_FAILED, updated_at=time.time() - 600)
    make_row(RowState.LEASE_FAILED, updated_at=time.time() - 60)
    make_row(RowState.RUNNING, updated_at=time.time() - 6000)  # another state: not counted
    assert 600 <= gauge() < 660


def test_each_pass_has_a_late_gauge_as_status_judges_it() -> None:
    settings = Settings(namespace="alerts", tick_seconds=5, reconcile_seconds=30, gc_seconds=3600)
    client = fakeredis.FakeRedis()
    for p in registry.PASSES:
        RedisCoordination(client, settings).record_scan(p.name, NOW - 3 * 5 - 1)  # tick passes late
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "time", lambda: NOW)
        found = {m.name: m for m in collectors.PlaneCollector(settings, client).collect()}
    late = {s.labels["pass_name"]: s.value for s in found["poolkeeper_pass_late"].samples}
    assert late == {"expire": 1, "lease_failures": 1, "results": 1, "reconcile": 0, "materialize": 1, "gc": 0}

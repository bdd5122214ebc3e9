"""Beat liveness and queue depth (``tasks.liveness``): what scanners stamp, what readers make of it."""

from __future__ import annotations

from unittest import mock

import fakeredis
import redis

from core.settings import Settings
from tasks import collectors, liveness, registry, scan
from tasks.coordination import LocalCoordination, queue_lists, waiting_key
from tasks.plane import Plane
from tasks.redis_coordination import RedisCoordination
from tests.factories import NOW

SETTINGS = Settings(namespace="live", tick_seconds=5, reconcile_seconds=30, gc_seconds=3600)


def test_a_finished_scan_stamps_its_pass(plane: Plane) -> None:
    assert isinstance(plane.coord, LocalCoordination)
    scan.scan(plane, "expire", NOW, lambda name, keys: None)
    assert plane.coord.scans == {"expire": NOW}


def test_each_pass_is_late_after_three_of_its_own_intervals_without_a_scan() -> None:
    client = fakeredis.FakeRedis()
    coord = RedisCoordination(client, SETTINGS)
    coord.record_scan("materialize", NOW - 3 * 30 - 1)  # the plane's first scan: reconcile was due
    coord.record_scan("expire", NOW - 3 * 5 + 1)  # just inside
    coord.record_scan("results", NOW - 3 * 5 - 1)  # just outside
    coord.record_scan("gc", NOW - 3 * 3600 + 1)
    got = {p.name: p for p in liveness.read(client, SETTINGS, NOW).scans}
    assert (got["expire"].late, got["results"].late, got["gc"].late) == (False, True, False)
    assert (got["reconcile"].last, got["reconcile"].late) == (None, True)  # never scanned
    assert set(got) == {p.name for p in registry.PASSES}


def every_pass_scanned(client: fakeredis.FakeRedis, at: float) -> None:
    for p in registry.PASSES:
        RedisCoordination(client, SETTINGS).record_scan(p.name, at)


def test_beat_is_not_alive_once_a_pass_at_the_tick_interval_is_late() -> None:
    """Beat died after every pass scanned: dead within 3 ticks, though reconcile and gc are on time."""
    client = fakeredis.FakeRedis()
    every_pass_scanned(client, NOW)
    assert liveness.read(client, SETTINGS, NOW + 3 * 5).beat_alive is True
    health = liveness.read(client, SETTINGS, NOW + 3 * 5 + 1)
    late = {p.name: p.late for p in health.scans}
    assert late == {"expire": True, "lease_failures": True, "results": True, "reconcile": False,
                    "materialize": True, "gc": False}  # fmt: skip
    assert health.beat_alive is False
    assert metric(client, NOW + 3 * 5 + 1, "poolkeeper_beat_alive") == 0


def test_one_tick_pass_that_stopped_scanning_is_enough_for_beat_not_alive() -> None:
    client = fakeredis.FakeRedis()
    every_pass_scanned(client, NOW)
    RedisCoordination(client, SETTINGS).record_scan("expire", NOW - 3 * 5 - 1)
    assert liveness.read(client, SETTINGS, NOW).beat_alive is False


def test_a_beat_just_started_is_alive_and_its_slower_passes_not_late_before_they_are_due() -> None:
    """Beat runs gc and reconcile first one interval after it starts: never scanned, and late only
    once the plane has scanned for three of their intervals (a fresh deployment's gc: 3 hours)."""
    client = fakeredis.FakeRedis()

    def tick_passes_scan(at: float) -> None:
        for p in registry.PASSES:
            if p.interval(SETTINGS) == SETTINGS.tick_seconds:
                RedisCoordination(client, SETTINGS).record_scan(p.name, at)

    tick_passes_scan(NOW)
    health = liveness.read(client, SETTINGS, NOW + 1)
    assert health.beat_alive is True
    assert {p.name for p in health.scans if p.late} == set()
    assert metric(client, NOW + 1, "poolkeeper_beat_alive") == 1
    tick_passes_scan(NOW + 3 * 30 + 1)
    assert {p.name for p in liveness.read(client, SETTINGS, NOW + 3 * 30 + 1).scans if p.late} == {
        "reconcile"
    }
    assert liveness.read(fakeredis.FakeRedis(), SETTINGS, NOW).beat_alive is False  # nothing ever scanned


def metric(client: fakeredis.FakeRedis, now: float, name: str) -> float:
    with mock.patch("time.time", return_value=now):
        found = {m.name: m for m in collectors.PlaneCollector(SETTINGS, client).collect()}
    return float(found[name].samples[0].value)


def test_queue_depth_counts_every_priority_list_of_this_namespace_only() -> None:
    client = fakeredis.FakeRedis()
    first, *_, last = queue_lists(SETTINGS)
    assert first == "live.maintenance" and last == "live.maintenance\x06\x169"
    client.rpush(first, "a", "b")
    client.rpush(last, "c")
    client.rpush("other.maintenance", "x")
    assert liveness.read(client, SETTINGS, NOW).queue_depth == 3


def test_claims_waiting_for_an_ordinal_are_counted_and_exported() -> None:
    client = fakeredis.FakeRedis()
    assert liveness.read(client, SETTINGS, NOW).waiting_claims == 0
    client.zadd(waiting_key("live"), {"b:t1:1": NOW, "b:t2:1": NOW + 1})  # as wait_for_ordinal keeps them
    assert liveness.read(client, SETTINGS, NOW).waiting_claims == 2
    assert metric(client, NOW, "poolkeeper_claims_waiting") == 2


def test_an_unreachable_redis_is_unknown_with_the_reason_never_an_error() -> None:
    away = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    health = liveness.read(away, SETTINGS, NOW)
    assert (health.queue_depth, health.beat_alive, health.waiting_claims) == (None, None, None)
    assert health.error and "redis at" in health.error
    assert all(p.late is None and p.last is None for p in health.scans)
    names = [m.name for m in collectors.PlaneCollector(SETTINGS, away).collect()]
    assert names == ["poolkeeper_redis_up"]


def test_metrics_show_each_scan_and_the_depth() -> None:
    client = fakeredis.FakeRedis()
    RedisCoordination(client, SETTINGS).record_scan("expire", NOW)
    found = {m.name: m for m in collectors.PlaneCollector(SETTINGS, client).collect()}
    scans = found["poolkeeper_last_scan_timestamp_seconds"].samples
    assert [(s.labels, s.value) for s in scans] == [({"pass_name": "expire"}, NOW)]
    assert found["poolkeeper_queue_depth"].samples[0].value == 0

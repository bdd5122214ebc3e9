"""Who serves the pool: each ordinal's pool worker (``store.numbers``) and the Celery workers and
beats of the namespace, by their beacons (``tasks.plane.Beacon``, read by ``tasks.liveness``)."""

from __future__ import annotations

from typing import Any

import fakeredis
import redis
from rich.console import Console

from board import Board
from core.settings import Settings
from poolkeeper.cli import render
from poolkeeper.status import snapshot
from store import PoolStore, numbers
from tasks import liveness, plane
from tasks.plane import Beacon
from tests.factories import NOW, OWNER, envelope

SETTINGS = Settings(namespace="workers", tick_seconds=5, reconcile_seconds=30, gc_seconds=3600)
LEASE = 30.0  # the settings fixture's lease


def _states(store: PoolStore, now: float) -> dict[int, str]:
    with store.session(readonly=True) as s:
        return {o: st.value for o, st in numbers.read(s, store.pool_size).worker_states(now, LEASE).items()}


def test_a_pool_worker_is_busy_while_it_holds_a_grant_polling_after_and_gone_after_a_lease(
    store: PoolStore,
) -> None:
    """Given one run on ordinal 0 and a worker that takes it; ordinals 1 and 2 never called."""
    store.add_run(board="b", task_id="t0", run_id=1, ordinal=0, payload={}, now=NOW)
    assert _states(store, NOW) == {0: "gone", 1: "gone", 2: "gone"}  # never seen: gone
    grant = store.offer(0, owner=OWNER, now=NOW)
    assert grant is not None
    assert _states(store, NOW + LEASE)[0] == "busy"  # one lease after its call: still there
    assert _states(store, NOW + LEASE + 1)[0] == "gone"  # one second past: gone, grant or not

    store.accept_result({**envelope(grant, "r1"), "payload": {"status": "done"}}, now=NOW + 10)
    assert _states(store, NOW + 10)[0] == "polling"  # its row holds a result: the worker asks again


def test_status_shows_what_each_pool_worker_holds(
    store: PoolStore, kanban: Board, settings: Settings
) -> None:
    store.add_run(board="b", task_id="t0", run_id=7, ordinal=0, payload={}, now=NOW)
    assert store.offer(0, owner=OWNER, now=NOW) is not None
    data = snapshot(store, kanban, settings, None, NOW + 1)
    first = data["presence"][0]
    assert (first["state"], first["holds"]) == (
        "busy",
        {"row": 1, "board": "b", "task_id": "t0", "run_id": 7, "state": "running"},
    )
    assert data["presence"][1]["holds"] is None
    shown = _text(render.status(data, store.pool_size))
    assert "busy: offer 1s ago by" in shown and "holds row 1 (b/t0 run 7)" in shown
    assert "celery workers and beats" in shown and "unknown" in shown  # no Redis given


def test_a_beacon_is_online_within_three_stamps_then_gone_since_its_last() -> None:
    client = fakeredis.FakeRedis()
    Beacon(client, SETTINGS, "worker", "w1@host").stamp(NOW)
    Beacon(client, SETTINGS, "beat", "beat@host").stamp(NOW - 3 * 5 - 1)
    got = liveness.read(client, SETTINGS, NOW + 3 * 5).processes
    assert got is not None
    assert [(p.kind, p.name, p.last, p.online) for p in got] == [
        ("beat", "beat@host", NOW - 16, False),  # beats first; gone since its last stamp
        ("worker", "w1@host", NOW, True),  # exactly three beacons old: still online
    ]
    later = liveness.read(client, SETTINGS, NOW + 3 * 5 + 1).processes
    assert later is not None and [p.online for p in later] == [False, False]
    shown = liveness.read(client, SETTINGS, NOW).as_json(NOW)["processes"]
    assert shown == [
        {"name": "beat@host", "kind": "beat", "last": NOW - 16, "age_seconds": 16.0, "online": False},
        {"name": "w1@host", "kind": "worker", "last": NOW, "age_seconds": 0.0, "online": True},
    ]


def test_the_beacons_are_kept_bounded_and_the_long_gone_forgotten() -> None:
    client = fakeredis.FakeRedis()
    key = plane.processes_key(SETTINGS.namespace)
    client.hset(key, "ancient", f"worker {NOW - plane.FORGET_PROCESS_SECONDS - 1!r}")
    client.hset(key, "someone-else", "not a beacon")
    for i in range(plane.MAX_PROCESSES + 5):
        Beacon(client, SETTINGS, "worker", f"w{i:03}").stamp(NOW + i)
    names = set(client.hkeys(key))
    assert len(names) == plane.MAX_PROCESSES
    assert b"ancient" not in names and b"someone-else" not in names and b"w000" not in names
    assert f"w{plane.MAX_PROCESSES + 4:03}".encode() in names  # the newest stay


def test_without_redis_the_celery_processes_are_unknown_not_an_error() -> None:
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    health = liveness.read(client, SETTINGS, NOW)
    assert health.processes is None and health.error is not None
    assert health.as_json(NOW)["processes"] is None


def _text(renderable: Any, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()

"""Who serves the pool: each ordinal's pool worker (``store.numbers``) and the Celery workers and
beats of the namespace, by their beacons (``tasks.redis_coordination.Beacon``, read by ``tasks.liveness``)."""

from __future__ import annotations

import time
from typing import Any

import fakeredis
import redis
from rich.console import Console

from board import Board, TaskStatus
from core.settings import Settings
from poolkeeper.cli import render
from poolkeeper.embedded import wait_for
from poolkeeper.status import snapshot
from store import PoolStore, audit, numbers, pause
from tasks import coordination, liveness, redis_coordination
from tasks.redis_coordination import Beacon
from tests.factories import NOW, OWNER, envelope
from tests.helpers import PlaneEnv

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
    key = coordination.processes_key(SETTINGS.namespace)
    client.hset(key, "ancient", f"worker {NOW - redis_coordination.FORGET_PROCESS_SECONDS - 1!r}")
    client.hset(key, "someone-else", "not a beacon")
    for i in range(redis_coordination.MAX_PROCESSES + 5):
        Beacon(client, SETTINGS, "worker", f"w{i:03}").stamp(NOW + i)
    names = set(client.hkeys(key))
    assert len(names) == redis_coordination.MAX_PROCESSES
    assert b"ancient" not in names and b"someone-else" not in names and b"w000" not in names
    assert f"w{redis_coordination.MAX_PROCESSES + 4:03}".encode() in names  # the newest stay


def test_without_redis_the_celery_processes_are_unknown_not_an_error() -> None:
    client = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, socket_timeout=0.2)
    health = liveness.read(client, SETTINGS, NOW)
    assert health.processes is None and health.error is not None
    assert health.as_json(NOW)["processes"] is None


def _text(renderable: Any, width: int = 200) -> str:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def test_a_paused_plane_claims_nothing_and_says_so_once_then_claims_on_resume(env: PlaneEnv) -> None:
    """Real Celery worker and beat: paused before they start, they serve a claimed run but claim no
    new task; resumed, the next ticks claim them all. Their beacons say both are online."""
    # Given a run claimed before the pause, and a paused store
    env.kanban.add_task("b", "claimed before", task_id="before")
    [claim] = env.kanban.claim_ready(1, assignee=env.settings.assignee, lane=env.settings.lane)
    env.store.add_run(
        board="b", task_id="before", run_id=claim.run_id, ordinal=0, payload={}, now=time.time()
    )
    with env.store.session() as s:
        pause.pause(s, "deploy 42", now=time.time(), actor=audit.OPERATOR)
    ids = env.add_tasks(3)
    worker, _ = env.worker(), env.beat()
    # When beat has sent dispatch many ticks
    client = env.redis.client()

    def scans_of_materialize() -> float:
        found = {p.name: p.last for p in liveness.read(client, env.settings, time.time()).scans}
        return found["materialize"] or 0.0

    wait_for("a dispatch tick", scans_of_materialize, 60)
    first = scans_of_materialize()
    wait_for("ten more ticks", lambda: scans_of_materialize() > first + 10 * env.settings.tick_seconds, 60)
    # Then nothing new was claimed, the claimed run is still served, and the plane said so once a process
    assert {t.id for t in env.kanban.list_tasks("b", TaskStatus.READY)} == set(ids)
    grant = env.store.offer(0, owner="pool-w0")
    assert grant is not None and grant.task_id == "before"
    said = worker.log.read_text().count("paused by operator: deploy 42")
    assert 1 <= said <= 2, said  # once per worker process that ran dispatch (two children)
    health = liveness.read(client, env.settings, time.time())
    assert health.processes is not None
    assert sorted((p.kind, p.online) for p in health.processes) == [("beat", True), ("worker", True)]

    # And once resumed, the next ticks claim the tasks
    with env.store.session() as s:
        pause.resume(s, now=time.time(), actor=audit.OPERATOR)
    wait_for("the tasks claimed", lambda: not env.kanban.list_tasks("b", TaskStatus.READY), 60)

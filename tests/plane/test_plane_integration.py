"""The plane end to end: real redis-server, real Celery worker and beat processes, real SQLite files."""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import sqlite3
import time
import urllib.request
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest
from sqlalchemy import text

from board import TaskStatus
from core.errors import StaleHolder
from core.settings import Settings
from poolkeeper.embedded import CeleryProc, free_port, wait_for
from poolkeeper.simulate import Faults, SimPool
from poolkeeper.workerhost.client import envelope
from store import Offer, PoolStore
from tasks import registry, scan
from tasks.coordination import process_task, queue_name
from tasks.declaration import Outcome
from tasks.plane import Plane
from tasks.redis_coordination import RedisCoordination, adrift_lead, adrift_seconds
from tests.factories import OWNER
from tests.helpers import PlaneEnv, make_settings

pytestmark = pytest.mark.integration


def assert_one_live_row_per_ordinal(e: PlaneEnv) -> None:
    with e.store.session(readonly=True) as s:
        dup = s.execute(
            text(
                "SELECT ordinal, count(*) FROM assignments WHERE state IN"
                " ('assigned','running','result') GROUP BY ordinal HAVING count(*) > 1"
            )
        ).all()
    assert dup == []


def test_every_task_ends_done_and_every_row_finalized(env: PlaneEnv) -> None:
    ids = env.add_tasks(40)
    env.worker()
    env.beat()
    pool = SimPool(env.store, Faults(work_seconds=0.05), seed=1).start()
    try:
        wait_for("every task done", lambda: env.board_done(ids), 90)
        wait_for(
            "every row finalized",
            lambda: all(r.state == "finalized" for r in env.rows().values()) and len(env.rows()) == 40,
            30,
        )
    finally:
        pool.stop()
    assert {r.attempt for r in env.rows().values()} == {1}
    # every pending marker was cleared by the message it stood for (none left to expire)
    wait_for("no pending markers", lambda: not env.redis.client().keys("poolkeeper:pending:*"), 5)


@pytest.mark.plane_settings(max_attempts=2, lease_seconds=1.5)
def test_expiry_fences_the_old_holder_then_parks_the_exact_run(env: PlaneEnv) -> None:
    [task] = env.add_tasks(1)
    env.worker()
    env.beat()
    first = wait_for(
        "the claim to reach an ordinal",
        lambda: next(filter(None, (env.store.offer(o, owner=OWNER) for o in range(4))), None),
        30,
    )
    assert isinstance(first, Offer)

    def reoffered() -> Offer | None:  # asked again by its holder, the live grant comes back unchanged
        again = env.store.offer(first.ordinal, owner=OWNER)
        return again if again is not None and again.attempt == 2 else None

    second = wait_for("the re-offer with attempt 2", reoffered, 30)
    assert isinstance(second, Offer)
    assert (second.attempt, second.row_id) == (2, first.row_id)
    assert second.fence > first.fence
    stale_writes: list[Callable[[], object]] = [
        lambda: env.store.heartbeat(envelope(first)),
        lambda: env.store.accept_result(envelope(first, payload={"status": "done"})),
    ]
    for stale in stale_writes:
        with pytest.raises(StaleHolder):
            stale()
    wait_for("the run parked and the row finalized", lambda: env.rows()[task].state == "finalized", 30)
    parked = env.kanban.get_task("b", task)
    assert parked is not None and parked.status is TaskStatus.BLOCKED
    assert parked.block_reason == "lease expired after 2 fenced attempts"


def _poison_result(e: PlaneEnv, task_id: str) -> None:
    with e.store.session() as s:
        s.execute(
            text("UPDATE assignments SET result='{corrupt' WHERE task_id=:t AND state='result'"),
            {"t": task_id},
        )


@pytest.mark.plane_settings(chaos_poison_tasks="p000,p001")
def test_poisoned_rows_are_quarantined_and_healthy_rows_finish_on_time(env: PlaneEnv) -> None:
    healthy = env.add_tasks(30, "h")
    poisoned_board = ["p000", "p001"]  # the board itself fails for these tasks
    env.add_tasks(2, "p")
    # a corrupted stored result, present before the plane even starts
    env.kanban.add_task("b", "corrupt", task_id="c000")
    [claim] = env.kanban.claim_ready(1, assignee="poolkeeper", lane="pool")
    env.store.add_run(board="b", task_id="c000", run_id=claim.run_id, ordinal=3, payload={"t": 1})
    offer = env.store.offer(3, owner=OWNER)
    assert offer is not None
    env.store.accept_result(envelope(offer, payload={"status": "done"}))
    _poison_result(env, "c000")

    started = time.monotonic()
    env.worker()
    env.beat()
    pool = SimPool(env.store, Faults(work_seconds=0.05), seed=2).start()
    try:
        wait_for("healthy tasks done", lambda: env.board_done(healthy), 90)
        healthy_seconds = time.monotonic() - started
        wait_for(
            "poisoned rows quarantined",
            lambda: all(t in env.rows() and env.rows()[t].quarantined for t in [*poisoned_board, "c000"]),
            90,
        )
    finally:
        pool.stop()
    rows = env.rows()
    assert "JSONDecodeError" in rows["c000"].last_error
    assert all("poisoned" in rows[t].last_error for t in poisoned_board)
    assert healthy_seconds < 90
    assert_one_live_row_per_ordinal(env)


@pytest.mark.plane_settings(max_attempts=1, lease_seconds=1.0)
def test_busy_board_keeps_lease_failed_until_it_answers(env: PlaneEnv) -> None:
    [task] = env.add_tasks(1)
    env.worker()
    env.beat()
    wait_for("a lease taken", lambda: any(env.store.offer(o, owner=OWNER) for o in range(4)), 30)
    blocker = sqlite3.connect(f"{env.tmp}/board.db", isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # another writer holds the board's write lock
    try:
        wait_for("lease_failed", lambda: env.rows()[task].state == "lease_failed", 30)
        wait_for("a failed recovery attempt", lambda: env.rows()[task].last_error, 40)
        assert env.rows()[task].state == "lease_failed"
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    wait_for("settled once the board answers", lambda: env.rows()[task].state == "finalized", 40)
    assert env.kanban.get_task("b", task).status is TaskStatus.BLOCKED  # type: ignore[union-attr]


def test_killed_worker_converges_after_restart(env: PlaneEnv) -> None:
    ids = env.add_tasks(40)
    worker = env.worker("w1")
    env.beat()
    pool = SimPool(env.store, Faults(work_seconds=0.1, crash_rate=0.1), seed=3).start()
    try:
        wait_for("some progress", lambda: sum(r.state == "finalized" for r in env.rows().values()) >= 5, 60)
        children = worker.children()
        assert children, "the prefork worker has children"
        os.kill(children[0], signal.SIGKILL)
        time.sleep(0.5)  # the main process notices its lost child; not a correctness wait
        worker.kill()
        assert_one_live_row_per_ordinal(env)
        env.worker("w2")
        wait_for("every task done or parked after restart", lambda: env.board_settled(ids), 120)
    finally:
        pool.stop()
    assert set(env.rows()) == set(ids)
    # A message lost with the killed worker frees its key's marker within a hold (half a tick,
    # tasks.redis_coordination.hold_seconds) and the next scan sends the key again; 30 s of room for the rest.
    bound = 30
    terminal = ("finalized", "stale")
    wait_for("every row terminal", lambda: all(r.state in terminal for r in env.rows().values()), bound)
    assert_one_live_row_per_ordinal(env)


def test_two_beats_apply_no_transition_twice(env: PlaneEnv) -> None:
    ids = env.add_tasks(30)
    env.worker()
    env.beat("beat1")
    env.beat("beat2")
    pool = SimPool(env.store, Faults(work_seconds=0.05), seed=4).start()
    try:
        wait_for("every task done", lambda: env.board_done(ids), 90)
        wait_for("every row finalized", lambda: all(r.state == "finalized" for r in env.rows().values()), 30)
    finally:
        pool.stop()
    with sqlite3.connect(f"{env.tmp}/board.db") as board:
        runs = board.execute(
            "SELECT task_id, count(*), sum(outcome = 'done') FROM runs GROUP BY task_id"
        ).fetchall()
    assert len(runs) == 30 and all(n == 1 and done == 1 for _, n, done in runs), "each task claimed once"
    with env.store.session(readonly=True) as s:
        fences = s.scalar(text("SELECT value FROM fence_sequence"))
    assert {r.attempt for r in env.rows().values()} == {1}
    assert fences == pool.stats["offers"] == 30, "each row was offered exactly once"


def _queued(e: PlaneEnv) -> list[tuple[str, list[Any]]]:
    out = []
    for raw in e.redis.client().lrange(queue_name(e.settings), 0, -1):
        msg = json.loads(raw)
        if msg["headers"]["task"] == process_task(e.settings):
            args = json.loads(base64.b64decode(msg["body"]))[0]
            out.append((args[0], args[1]))
    return out


def expired_leases(e: PlaneEnv, k: int, **over: Any) -> tuple[Settings, Plane, scan.Enqueue]:
    """K running rows whose leases ended long ago, a plane on them, and an enqueue into the real queue."""
    settings = make_settings(e.tmp, e.redis.url, pool_size=k, **over)
    store = PoolStore.from_settings(settings)
    for i in range(k):
        store.add_run(board="b", task_id=f"s{i}", run_id=1, ordinal=i, payload={}, now=0)
        assert store.offer(i, owner=OWNER, now=0) is not None
    plane = Plane(settings, store, e.kanban, RedisCoordination(e.redis.client(), settings))
    from tasks.celery import make_app

    app = make_app(settings)

    def enqueue(pass_name: str, keys: list[Any]) -> None:
        app.send_task(process_task(settings), (pass_name, keys), queue=queue_name(settings))

    return settings, plane, enqueue


def test_a_storm_never_queues_more_than_one_message_per_row(env: PlaneEnv) -> None:
    k = 60
    settings, plane, enqueue = expired_leases(env, k)
    for _ in range(5):  # five ticks (or two beats) with no worker consuming: the slowest worker
        scan.scan(plane, "expire", time.time(), enqueue)
        queued = [key for pass_name, keys in _queued(env) if pass_name == "expire" for key in keys]
        assert len(queued) == len(set(queued)) <= k
    assert len(queued) == k
    proc = CeleryProc("worker", settings.env(), env.tmp, "storm")
    env.procs.append(proc.wait_ready())
    wait_for("every row re-offered", lambda: all(r.state == "assigned" for r in env.rows().values()), 60)
    assert {r.attempt for r in env.rows().values()} == {2}, "no row expired twice"


def test_a_message_taken_by_a_worker_that_died_before_holding_it_is_sent_again(env: PlaneEnv) -> None:
    k, tick = 20, 1.0
    settings, plane, enqueue = expired_leases(env, k, tick_seconds=tick, task_time_limit=2.0)
    bound = adrift_seconds(settings) + adrift_lead(settings) + tick  # 8 s: a scan a tick
    assert scan.scan(plane, "expire", time.time(), enqueue) == k
    # A worker takes the message off the queue (kombu's BRPOP) and is killed before its
    # task_received hold: the message is gone, its keys' markers still say "queued".
    taken = time.monotonic()
    assert env.redis.client().rpop(queue_name(settings)) is not None
    assert scan.scan(plane, "expire", time.time(), enqueue) == 0, "its markers stand a while"

    # Then a scan a tick sends the keys again once they are adrift, not at the visibility timeout
    def scanned() -> int:
        time.sleep(tick)  # beat's pace
        return scan.scan(plane, "expire", time.time(), enqueue)

    sent = wait_for("the keys sent again", scanned, 60, every=0)
    took = time.monotonic() - taken
    assert sent == k and took <= bound + 1.5, f"sent again {took:.1f}s after the message was lost"
    assert took >= adrift_seconds(settings), "never while its message may still be in flight"
    proc = CeleryProc("worker", settings.env(), env.tmp, "taker")
    env.procs.append(proc.wait_ready())
    wait_for("every row re-offered", lambda: all(r.state == "assigned" for r in env.rows().values()), 60)
    assert {r.attempt for r in env.rows().values()} == {2}, "no row expired twice"
    assert scan.scan(plane, "expire", time.time(), enqueue) == 0


def test_redis_outage_loses_nothing(env: PlaneEnv) -> None:
    ids = env.add_tasks(30)
    env.worker()
    env.beat()
    pool = SimPool(env.store, Faults(work_seconds=0.1), seed=5).start()
    try:
        wait_for("some progress", lambda: sum(r.state == "finalized" for r in env.rows().values()) >= 5, 60)
        env.redis.stop()
        time.sleep(3)  # the outage itself: the plane must ride it out
        env.redis.start()
        # kombu may crash a worker that acks while the broker is gone (an "Unrecoverable
        # error" on a closed channel); with late acks nothing is lost and the supervisor
        # restarts it, as the deploy/ units do.
        wait_for("every task done after the outage", lambda: env.supervise() or env.board_done(ids), 120)
    finally:
        pool.stop()
    rows = env.rows()
    assert set(rows) == set(ids)
    wait_for("every row finalized", lambda: all(r.state == "finalized" for r in env.rows().values()), 30)
    assert_one_live_row_per_ordinal(env)


def test_worker_exports_prometheus_metrics(env: PlaneEnv) -> None:
    port = free_port()
    env.settings = replace(env.settings, metrics_port=port)
    ids = env.add_tasks(5)
    env.worker()
    env.beat()
    pool = SimPool(env.store, Faults(work_seconds=0.05), seed=6).start()
    try:
        wait_for("every task done", lambda: env.board_done(ids), 60)
    finally:
        pool.stop()

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    # Every run's wait (ready -> claimed, in materialize) and run time (grant -> result, in results),
    # observed once in the Celery children and merged by the exporter.
    counted = ("poolkeeper_task_wait_seconds_count 5.0", "poolkeeper_run_seconds_count 5.0")
    body = str(
        wait_for(
            "finalized rows, their waits and run times in the metrics",
            lambda: (
                (got := scrape())
                and 'poolkeeper_rows{state="finalized"} 5.0' in got
                and all(c in got for c in counted)
                and "poolkeeper_redis_up 1.0" in got  # beat alive: a scan within its last ticks, which a
                and "poolkeeper_beat_alive 1.0" in got  # loaded machine may have let lapse a moment
                and got
            ),
            30,
        )
    )
    assert 'poolkeeper_task_wait_seconds_bucket{le="86400.0"} 5.0' in body
    assert 'poolkeeper_run_seconds_bucket{le="0.001"} 0.0' in body  # each ran its 50 ms at least
    assert 'poolkeeper_pass_outcomes_total{outcome="finalized",pass_name="results"}' in body
    assert 'poolkeeper_pass_outcomes_total{outcome="added",pass_name="materialize"}' in body
    assert "poolkeeper_quarantined_rows 0.0" in body
    assert 'poolkeeper_ordinals{state="free"} 4.0' in body
    assert 'poolkeeper_ordinals{state="quarantined"} 0.0' in body
    assert "poolkeeper_expiry_to_reoffer_seconds_bucket" in body
    assert 'poolkeeper_last_scan_timestamp_seconds{pass_name="materialize"}' in body
    assert "poolkeeper_queue_depth " in body and "poolkeeper_audit_events_written " in body
    labels = set(re.findall(r'poolkeeper_pass_outcomes_total\{outcome="([^"]*)",pass_name="([^"]*)"\}', body))
    allowed = {(o.value, p.name) for o in Outcome for p in registry.PASSES}
    assert labels and labels <= allowed, f"unbounded labels: {labels - allowed}"

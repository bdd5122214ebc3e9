"""A Celery worker survives a Redis restart: the same process, serving again each time.

Real redis-server on a port of the test's own, a real Celery worker and beat, real SIGKILL
of Redis while messages are in flight (a pool of simulated workers keeps the plane busy).
"""

from __future__ import annotations

import time

import pytest

from poolkeeper.embedded import CeleryProc, wait_for
from poolkeeper.simulate import Faults, SimPool
from tests.helpers import PlaneEnv

pytestmark = pytest.mark.integration

RESTARTS = 3
LOST = "Connection to broker lost"


def restart_redis(env: PlaneEnv, worker: CeleryProc) -> None:
    """Kill Redis with messages in flight; start it again once the worker saw it go."""
    seen = worker.text().count(LOST)
    env.redis.stop()
    wait_for("the worker to see the broker go", lambda: worker.text().count(LOST) > seen, 30)
    time.sleep(0.5)  # acks and the consumer's restart meet the dead broker
    env.redis.start()


def served(env: PlaneEnv, worker: CeleryProc, ids: list[str]) -> float:
    """Seconds until ``ids`` have rows (the worker dispatched them); then waits until they are done."""
    start = time.monotonic()
    wait_for("rows for the fresh tasks", lambda: worker.crashed() or set(ids) <= set(env.rows()), 60)
    took = time.monotonic() - start
    wait_for("the fresh tasks done", lambda: worker.crashed() or env.board_done(ids), 60)
    assert not worker.crashed(), f"the worker exited:\n{worker.text()[-3000:]}"
    return took


def test_a_celery_worker_rides_out_three_redis_restarts_under_load(env: PlaneEnv) -> None:
    # Given a worker (started as deploy/ starts it: no --without-* flags) and beat serving a busy pool
    worker = env.worker()
    env.beat()
    pool = SimPool(env.store, Faults(work_seconds=0.05), seed=28).start()
    try:
        ids = env.add_tasks(20, prefix="before")
        wait_for("some progress", lambda: sum(r.state == "finalized" for r in env.rows().values()) >= 3, 60)
        for n in range(RESTARTS):
            # When Redis is killed with messages in flight and comes back
            restart_redis(env, worker)
            # Then the same worker process serves the work claimed after the restart
            fresh = env.add_tasks(5, prefix=f"after{n}-")
            print(f"restart {n + 1}: rows {served(env, worker, fresh):.1f}s after Redis was back")
            ids += fresh
        wait_for("every task done", lambda: env.board_done(ids), 60)
    finally:
        pool.stop()
    assert worker.proc.poll() is None, "still the same process"
    assert "Unrecoverable error" not in worker.text()


@pytest.mark.plane_settings(tick_seconds=1.0)
def test_a_worker_is_back_on_its_broker_within_a_tick_of_a_long_outage_ending(env: PlaneEnv) -> None:
    # Given a worker whose Redis has been away for longer than kombu's own backoff reaches (2 s + 4 s + ...)
    worker = env.worker()
    env.redis.stop()
    wait_for("the worker to see the broker go", lambda: LOST in worker.text(), 30)
    time.sleep(13)
    # When Redis is back
    connected = worker.text().count("Connected to")
    env.redis.start()
    back = time.monotonic()
    # Then the worker is connected again within a tick (it tries every half tick), not at kombu's next step
    wait_for("the worker to connect", lambda: worker.text().count("Connected to") > connected, 30, every=0.02)
    took = time.monotonic() - back
    assert took <= env.settings.tick_seconds, f"connected {took:.1f}s after Redis was back"
    assert not worker.crashed()

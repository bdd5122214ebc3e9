"""Events drive the passes; beat is the safety net (real redis-server, Celery, ``serve``, pool workers).

With no beat at all and a tick of a minute, tasks added with ``poolctl board add`` are claimed,
run by the pool's workers and done on the board: every step was sent by an event (the add, the
waiting offer, the accepted result, the freed ordinal). A lost event, or a Redis restart between
an event and its task, costs a tick: beat's scans find the work.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from poolkeeper.embedded import ServeProc, wait_for
from tests.helpers import SECRET, PlaneEnv, poolctl, worker

pytestmark = pytest.mark.integration


@pytest.fixture
def served(env: PlaneEnv) -> Iterator[ServeProc]:
    proc = ServeProc(env.settings.env(), env.tmp, secret=SECRET)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def add(env: PlaneEnv, *titles: str) -> list[str]:
    """``poolctl board add`` for each title, as an operator types it: the new tasks' ids."""
    ids = []
    for title in titles:
        done = poolctl(env.tmp, "board", "add", "b", title, env=env.settings.env())
        assert done.returncode == 0, done.stderr
        ids.append(done.stdout.strip())
    return ids


@pytest.mark.plane_settings(pool_size=2, tick_seconds=60.0, reconcile_seconds=600.0)
def test_with_no_beat_every_step_is_sent_by_an_event(env: PlaneEnv, served: ServeProc) -> None:
    # Given a Celery worker and a pool worker per ordinal, and no beat: its first tick is a minute away
    env.worker()
    workers = [worker(served, "cat", ordinal=o) for o in range(2)]
    try:
        # When tasks are added, more than the pool holds at once
        ids = add(env, "one", "two", "three", "four", "five")
        # Then each is claimed, run and done on the board long before any tick
        wait_for("every task done on the board", lambda: env.board_done(ids), 30)
    finally:
        for w in workers:
            w.terminate()
            w.wait(20)


@pytest.mark.plane_settings(pool_size=2, tick_seconds=1.0)
def test_an_event_lost_to_a_redis_restart_costs_a_tick(env: PlaneEnv, served: ServeProc) -> None:
    # Given no Celery worker to hear it, a task added (its event pushed), then Redis restarted: event gone
    [task] = add(env, "survives")
    env.redis.stop()
    env.redis.start()
    # When the plane comes up with its beat, Then beat's scans find the task (at most a tick and a run)
    env.worker()
    env.beat()
    workers = [worker(served, "cat", ordinal=o) for o in range(2)]
    try:
        wait_for("the task done on the board", lambda: env.board_done([task]), 30)
    finally:
        for w in workers:
            w.terminate()
            w.wait(20)

"""Coordination heals itself: whatever a killed process held is free again within 2 ticks.

Real redis-server, real Celery worker processes, real SIGKILL. A process is made to
hold what it holds by taking a database's write lock from the test (SQLite's busy
wait then keeps it inside the board or store call); the lock's token names its holder.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]  # (PyYAML comes with yamllint, a dev dependency)

from board import TaskStatus
from poolkeeper.embedded import CeleryProc, supervise, wait_for
from poolkeeper.testing.board_contract import sqlite_write_lock
from tests.helpers import PlaneEnv

pytestmark = pytest.mark.integration

TICK, RECONCILE = 2.0, 3.0  # a hold is then half a tick (1 s), as at the defaults
# What a loaded two-core machine adds to a bound: messages, a scan's own work, a child's start.
SLACK = 1.5


def start_worker(e: PlaneEnv, name: str) -> CeleryProc:
    proc = CeleryProc("worker", e.settings.env(), e.tmp, name, concurrency=1)
    e.procs.append(proc)
    return proc.wait_ready()


def holder(e: PlaneEnv, lock: str) -> int | None:
    """The pid that holds ``lock`` (its token is ``host:pid:random``), or None while it is free."""
    token = e.redis.client().get(f"{e.settings.namespace}:lock:{lock}")
    return int(token.split(b":")[1]) if isinstance(token, bytes) else None


def wait_holder(e: PlaneEnv, lock: str) -> int:
    got = wait_for(f"a process holding {lock}", lambda: holder(e, lock), 30, every=0.05)
    assert isinstance(got, int)
    return got


def wait_alone(e: PlaneEnv) -> int:
    """The one ordinal reserved (a dispatch tick may hold others for a moment: this one stays)."""
    got = wait_for("one reservation alone", lambda: len(r := reservations(e)) == 1 and r, 10, every=0.02)
    assert isinstance(got, set)
    return int(next(iter(got)))


def worker_of(e: PlaneEnv, pid: int) -> CeleryProc:
    [proc] = [p for p in e.procs if pid in p.children()]
    return proc


def kill(e: PlaneEnv, victim: str, pid: int) -> float:
    """SIGKILL the holding child, or its whole worker; the moment it died."""
    if victim == "child":
        os.kill(pid, signal.SIGKILL)
    else:
        worker_of(e, pid).kill()
    return time.monotonic()


def reservations(e: PlaneEnv) -> set[int]:
    prefix = f"{e.settings.namespace}:reserved:"
    return {int(k[len(prefix) :]) for k in e.redis.client().keys(prefix + "*")}


def elapsed_until(what: str, check: Any, since: float, timeout: float) -> float:
    wait_for(what, check, timeout, every=0.05)
    return time.monotonic() - since


@pytest.mark.plane_settings(tick_seconds=TICK, reconcile_seconds=RECONCILE)
@pytest.mark.parametrize("victim", ["child", "worker"])
def test_dispatch_resumes_within_two_ticks_after_its_holder_is_killed(env: PlaneEnv, victim: str) -> None:
    # Given two workers and beat, and a board that keeps the dispatcher inside claim_ready
    start_worker(env, "w1")
    start_worker(env, "w2")
    env.beat()
    with sqlite_write_lock(env.tmp / "board.db")():
        pid = wait_holder(env, "dispatch")
        # When the dispatcher (its child, or its whole worker) is killed while it holds the lock
        killed = kill(env, victim, pid)
    [task] = env.add_tasks(1)
    # Then the next dispatch claims within 2 ticks (once the lock lapsed and a tick came)
    took = elapsed_until(
        "a ready task claimed",
        lambda: env.kanban.get_task("b", task).status is TaskStatus.RUNNING,  # type: ignore[union-attr]
        killed,
        60,
    )
    assert took <= 2 * TICK + SLACK, f"dispatch resumed {took:.1f}s after its holder died"


@pytest.mark.plane_settings(tick_seconds=TICK, reconcile_seconds=RECONCILE)
@pytest.mark.parametrize("victim", ["child", "worker"])
def test_a_claim_whose_materializer_is_killed_gets_its_row_within_two_reconcile_intervals(
    env: PlaneEnv, victim: str
) -> None:
    # Given two workers and beat, and a store that keeps materialize inside add_run
    start_worker(env, "w1")
    start_worker(env, "w2")
    env.beat()
    with sqlite_write_lock(env.tmp / "pool.db")():
        [task] = env.add_tasks(1)
        pid = wait_holder(env, f"materialize:b:{task}:1")
        ordinal = wait_alone(env)
        # When the child materializing the claim (or its whole worker, the message unacked) dies
        killed = kill(env, victim, pid)

    # Then its reservation is free within 2 ticks, or already taken by the claim's row
    def freed() -> bool:
        row = env.rows().get(task)
        return ordinal not in reservations(env) or (row is not None and row.ordinal == ordinal)

    freed_after = elapsed_until(f"ordinal {ordinal}'s reservation freed", freed, killed, 60)
    assert freed_after <= 2 * TICK + SLACK, f"the reservation lived {freed_after:.1f}s past its holder"
    # and the claim has its row within 2 reconcile intervals
    took = elapsed_until("the claim's row", lambda: task in env.rows(), killed, 60)
    assert took <= 2 * RECONCILE + SLACK, f"the claimed run had no row for {took:.1f}s"
    assert env.rows()[task].state == "assigned"


@pytest.mark.plane_settings(tick_seconds=TICK, reconcile_seconds=RECONCILE)
def test_a_worker_under_a_redis_restart_reconnects_or_exits_and_is_restarted(env: PlaneEnv) -> None:
    # Given a worker and beat serving, the worker in the middle of a message (unacknowledged)
    worker = start_worker(env, "w1")
    env.beat()
    with sqlite_write_lock(env.tmp / "pool.db")():
        [during] = env.add_tasks(1, prefix="during")
        wait_holder(env, f"materialize:b:{during}:1")
        # When Redis restarts under them (its queue, markers and reservations gone with it),
        # coming back only once the worker saw it go
        env.redis.stop()
        wait_for("the worker to see the broker go", lambda: "Connection to broker lost" in worker.text(), 30)
        env.redis.start()
    restarted = time.monotonic()
    [after] = env.add_tasks(1, prefix="after")

    # Then the worker reconnects, or exits promptly and its supervisor starts another
    def served() -> bool:
        env.procs = supervise(env.procs, env.settings.env(), env.tmp)
        return {during, after} <= set(env.rows())

    took = elapsed_until("rows for the claims of before and after the restart", served, restarted, 90)
    assert took <= 30, f"the plane served again {took:.0f}s after the restart"
    if worker.proc.poll() is not None:
        assert any(p.name == "w1r" for p in env.procs), "an exited worker is restarted"


def test_the_supervisor_restarts_a_killed_worker_and_leaves_a_stopped_one(env: PlaneEnv) -> None:
    crashing, stopped = start_worker(env, "w1"), start_worker(env, "w2")
    stopped.stop()
    os.kill(crashing.proc.pid, signal.SIGKILL)  # as kombu's exit after a Redis restart: not on purpose
    crashing.proc.wait(10)
    procs = supervise(env.procs, env.settings.env(), env.tmp)
    env.procs = procs
    assert [p.name for p in procs] == ["w1r", "w2"]
    procs[0].wait_ready()
    assert procs[0].proc.poll() is None and stopped.proc.poll() is not None


DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_every_deploy_file_restarts_workers_and_beat_whenever_they_exit() -> None:
    for compose in sorted(DEPLOY.glob("docker-compose*.yml")):
        services = yaml.safe_load(compose.read_text())["services"]
        for name in ("worker", "beat"):
            assert services[name]["restart"] == "always", f"{compose.name}: {name}"
    manifests = list(yaml.safe_load_all((DEPLOY / "k8s" / "poolkeeper.yaml").read_text()))
    for name in ("poolkeeper-worker", "poolkeeper-beat"):
        [deployment] = [m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == name]
        # A Deployment's pods restart their containers always (the only policy it allows)
        assert deployment["spec"]["template"]["spec"].get("restartPolicy", "Always") == "Always"
    for name in ("worker", "beat"):
        unit = (DEPLOY / "systemd" / f"poolkeeper-{name}.service").read_text().splitlines()
        assert "Restart=always" in unit and "StartLimitIntervalSec=0" in unit, f"{name}.service"

"""The Celery app and its thin tasks: open the plane, call one function, log one line.

Settings: JSON only, late acks, reject on worker lost, prefetch 1, soft and
hard time limits, a broker visibility timeout longer than any countdown,
results ignored, one ``maintenance`` queue. Nothing runs at start-up: a worker
or beat with poisoned rows in the store comes up and serves.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from celery import Celery, Task
from celery.exceptions import SoftTimeLimitExceeded
from celery.signals import worker_init, worker_process_init, worker_process_shutdown
from kombu.entity import Queue

import beat_schedule
from poolkeeper.errors import TransientError
from poolkeeper.settings import Settings
from store import PoolStore
from store.transitions import backoff
from tasks import metrics, runner, scan
from tasks import plane as planes

log = logging.getLogger("poolkeeper.maintenance")
QUEUE = "maintenance"


def make_app(settings: Settings) -> Celery:
    celery = Celery("poolkeeper", broker=planes.worker_redis_url(settings))
    celery.conf.update(
        task_serializer="json",
        accept_content=["json"],
        result_serializer="json",
        task_ignore_result=True,
        result_backend=None,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_time_limit=settings.task_time_limit,
        task_soft_time_limit=settings.task_time_limit * 0.8,
        broker_transport_options={"visibility_timeout": settings.visibility_timeout},
        broker_connection_retry_on_startup=True,
        task_default_queue=QUEUE,
        task_queues=[Queue(QUEUE)],
        worker_hijack_root_logger=True,
        beat_schedule=beat_schedule.schedule(settings),
    )
    return celery


app = make_app(Settings.from_env())


@worker_process_init.connect
def _fresh_plane_in_child(**_: Any) -> None:
    planes.forget_after_fork()


@worker_init.connect
def _worker_start(**_: Any) -> None:
    settings = Settings.from_env()
    if settings.metrics_port:
        metrics.start_exporter(settings.metrics_port, settings.http_host, PoolStore(settings))
        log.info("metrics on http://%s:%d/metrics", settings.http_host, settings.metrics_port)


@worker_process_shutdown.connect
def _forget_child_metrics(pid: int | None = None, **_: Any) -> None:
    metrics.child_exited(pid or os.getpid())


def _enqueue(pass_name: str, keys: list[Any]) -> None:
    process.apply_async((pass_name, keys))


@app.task(name="poolkeeper.scan")
def scan_due(pass_name: str) -> None:
    """Beat: enqueue the due rows of one row pass."""
    try:
        n = scan.scan(planes.current(), pass_name, time.time(), _enqueue)
    except TransientError as err:
        log.warning("scan %s: skipped this tick: %s", pass_name, err)
        return
    if n:
        log.info("scan %s: enqueued %d rows", pass_name, n)


@app.task(name="poolkeeper.dispatch")
def dispatch() -> None:
    """Beat: claim ready tasks for free ordinals, enqueue their materialization."""
    n = scan.dispatch(planes.current(), _enqueue)  # a non-transient error surfaces loudly
    if n:
        log.info("dispatch: claimed %d tasks", n)


@app.task(name="poolkeeper.scan_boards")
def scan_boards() -> None:
    """Beat: enqueue one reconcile per board."""
    try:
        scan.scan_boards(planes.current(), _enqueue)
    except TransientError as err:
        log.warning("reconcile: board list unavailable this tick: %s", err)


@app.task(name="poolkeeper.gc")
def collect_garbage() -> None:
    """Beat: delete terminal rows past retention (bounded)."""
    try:
        runner.run_key(planes.current(), "gc", "all", time.time())
    except TransientError as err:
        log.warning("gc: skipped this tick: %s", err)


@app.task(name="poolkeeper.process", bind=True, max_retries=None)
def process(self: Task, pass_name: str, keys: list[Any]) -> None:
    """Run each key of one pass in isolation; split out transient failures and retry them alone."""
    plane = planes.current()
    now = time.time()
    try:
        result = runner.run_batch(plane, pass_name, keys, now)
    except SoftTimeLimitExceeded:
        log.warning("%s: soft time limit hit; the unfinished keys are rescanned", pass_name)
        _clear(plane, pass_name, keys)
        return
    if summary := result.summary():
        log.info("%s: %s", pass_name, summary)
    finished = [key for key, _ in result.done]
    again = []
    for key, err in result.transient:
        if self.request.retries < plane.settings.transient_retries:
            again.append(key)
        else:
            runner.give_up_transient(plane, pass_name, key, err, now)
            finished.append(key)
    _clear(plane, pass_name, finished)
    if len(keys) == 1 and again:  # keep the marker: this message stays pending
        raise self.retry(countdown=backoff(self.request.retries + 1, plane.settings))
    for key in again:  # a failing key is split out and retried alone
        process.apply_async((pass_name, [key]), countdown=backoff(1, plane.settings))


def _clear(plane: planes.Plane, pass_name: str, keys: list[Any]) -> None:
    try:
        plane.coord.clear_pending(pass_name, [runner.key_name(pass_name, k) for k in keys])
    except TransientError as err:
        log.warning("%s: pending markers left to expire: %s", pass_name, err)
